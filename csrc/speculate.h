// Batched drafting across sources (a trajectory's own tree, its group's history,
// everyone's history). Knows: how to pick the best draft among trees.
// Does not know: where the trees come from or when they change (war/spec).
// Combining: the best single source (section 4) or a merge of all (section 6).
#pragma once

#include <cstdint>
#include <vector>

#include "suffix_tree.h"

namespace war {

enum class Source : int8_t { kNone = 0, kGroup = 1, kLocal = 2, kGlobal = 3 };

struct BatchItem {
  const SuffixTree* local = nullptr;  // holds the trajectory as sequence `seq_id`
  int64_t seq_id = 0;
  const SuffixTree* group = nullptr;  // may be empty, never null
  int32_t budget = 0;                 // most draft tokens for this sequence now
};

struct BatchResult {
  std::vector<int32_t> tokens;    // all drafts, concatenated
  std::vector<int32_t> parents;   // per token, index within its own draft (-1 = root)
  std::vector<double> probs;      // per token, cumulative probability
  std::vector<int64_t> offsets;   // draft i is [offsets[i], offsets[i+1])
  std::vector<double> scores;     // per draft, unweighted score
  std::vector<int8_t> sources;    // per draft, a Source
  std::vector<int32_t> match_lens;
};

// How the sources' drafts combine (docs/suffix-speculation.md, sections 4 and 6).
struct MergeParams {
  bool enabled = false;    // false: the single best source; true: merge every source
  double threshold = 0.5;  // merged value a kept token needs (theta)
  double min_prob = 0.05;  // each source's tree-draft cut inside a merge
};

// One call per engine step; touches no Python state (callers release the GIL).
// `params[s]` are the drafting parameters of source s (group, local, global): the
// same but for their smoothing tables (alpha). `params[0].tree` is the draft shape.
void propose_batch(const std::vector<BatchItem>& items, const SuffixTree* global,
                   const SpecParams (&params)[3], double group_weight, const MergeParams& merge,
                   BatchResult* out);

}  // namespace war
