// Path-compressed, depth-limited suffix trie with occurrence counts.
//
// Knows: sequences of int32 token ids, the counts of all their substrings up to
// `max_depth` tokens, and how to draft continuations of a context from those
// counts. Does not know: models, groups, RL steps, Python (see bindings.cc and
// war/spec/tree.py, the only Python module that imports this code).
//
// The semantics are those of an uncompressed trie over every suffix of every
// sequence, cut at depth D (docs/suffix-speculation.md). This implementation
// stores the same information path-compressed:
//
//  * A node stands for a chain of uncompressed trie nodes that all have the same
//    count and (but for the last) exactly one child. Its label (the chain's
//    tokens) is not stored: it is read from a sequence that contains the node's
//    whole root-to-node path, `ref`.
//  * A suffix that is still growing (its sequence may be appended to and it is
//    shorter than D) always ends at a node end. Appending a token moves each such
//    suffix one token deeper: into an existing child (split if that child's
//    label is longer than one token), into a new child, or, when the suffix is
//    the only occupant of a leaf, by growing that leaf's label in place.
//  * After every change a parent with a single child of equal count is merged
//    into that child, so chains stay compressed.
//  * A leaf whose one occurrence is a growing suffix is *open*: its label runs to
//    the end of its sequence (capped at depth D) and grows with it for free. The
//    suffixes in open leaves are the longest ones of their sequence (a longer
//    string occurs no more often), so appending a token only visits the
//    suffixes that still end at explicit nodes: O(1) per token in text that is
//    new, O(length of the repeat) in text that repeats.
//
// Sequences live in slots. A slot's tokens are kept while any node references
// them, even after the sequence was removed (a "zombie"); removal re-points
// references to live sequences where it can, so zombies are rare in practice
// and are included in memory accounting.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "flat_index.h"

namespace war {

struct Node;

// Reports a broken invariant (what check_integrity and removal detect).
[[noreturn]] inline void fail(const std::string& what) {
  throw std::runtime_error("suffix tree integrity: " + what);
}

// An entry of a node's child list. The first token and the count are copied in
// the list so that lookups and reordering read one contiguous array instead of
// every child node.
struct Child {
  int32_t token;
  int32_t count;  // == node->count
  Node* node;
};

struct Node {
  int32_t token = -1;      // first token of the label (the key in the parent's list)
  int32_t count = 0;       // occurrence count shared by every token of the label
  int32_t child_sum = 0;   // sum of the children's counts (occurrences that continue)
  int32_t length = 0;      // label length in tokens (closed nodes; 0 for the root)
  int32_t ref_pos = 0;     // closed: end of the label in slot ref_slot; open: its start
  uint32_t ref_slot = 0;   // slot holding an occurrence of this node's whole path
  uint32_t pos = 0;        // index of this node in parent->children
  int32_t open_depth = -1; // open leaf: trie depth where its label starts; else -1
  Node* parent = nullptr;  // nullptr only for the root
  std::vector<Child> children;  // sorted by count, descending (tie rules: docs)
  std::unique_ptr<FlatIndex> index;  // token -> child, for wide nodes
};

// A place in the trie: `offset` label tokens of `node` have been matched
// (offset == the label's length means the node's end).
struct Position {
  Node* node = nullptr;
  int32_t offset = 0;
};

struct DraftResult {
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;  // -1 = attached to the context
  std::vector<double> probs;     // cumulative probability of each token
  double score = 0.0;            // sum of probs: expected accepted tokens
  int32_t match_len = 0;
};

struct SpecParams {
  int32_t max_tokens = 16;
  double factor = 1.0;
  double offset = 0.0;
  double min_prob = 0.1;
  const double* alpha = nullptr;  // smoothing by depth: alpha[d], d in [0, max_depth]
  bool tree = false;
  // alpha[d] never grows with d: a match length whose occurrences are those of a
  // longer one cannot draft better than it and is skipped (docs: section 3).
  bool alpha_nonincreasing = false;
};

class SuffixTree {
 public:
  explicit SuffixTree(int32_t max_depth);
  ~SuffixTree();
  SuffixTree(const SuffixTree&) = delete;
  SuffixTree& operator=(const SuffixTree&) = delete;

  int32_t max_depth() const { return max_depth_; }

  // Appends tokens to sequence `seq_id`, creating it if new.
  void append(int64_t seq_id, const int32_t* tokens, size_t n);
  // Appends tokens [start, end) of another tree's sequence (no Python copy).
  void append_from(int64_t seq_id, const SuffixTree& other, int64_t other_id, int64_t start,
                   int64_t end);
  // Frees the per-sequence bookkeeping needed to append more tokens (for
  // sequences that are complete, such as history entries).
  void seal(int64_t seq_id);
  // Removes a sequence and all its counts. Throws std::invalid_argument if unknown.
  void remove(int64_t seq_id);

  bool contains(int64_t seq_id) const { return ids_.count(seq_id) != 0; }
  int64_t seq_len(int64_t seq_id) const;
  const std::vector<int32_t>& sequence(int64_t seq_id) const;
  size_t num_seqs() const { return ids_.size(); }
  size_t num_nodes() const { return num_nodes_; }
  int64_t num_tokens() const { return num_tokens_; }  // tokens of live sequences
  size_t memory_bytes() const;

  int32_t count(const int32_t* path, size_t n) const;
  std::vector<std::pair<int32_t, int32_t>> children(const int32_t* path, size_t n) const;
  int32_t match_len(const int32_t* ctx, size_t n) const;

  // Best draft over all match lengths of the context's suffix (docs, section 3).
  DraftResult speculate(const int32_t* ctx, size_t n, const SpecParams& p) const;
  // The same, for the context that is sequence `seq_id` itself, using its growing
  // suffixes instead of walking from the root.
  DraftResult speculate_self(int64_t seq_id, const SpecParams& p) const;
  // In-place forms for hot loops: `out` is overwritten, its buffers reused.
  // Match lengths that cannot beat a score of `bar` are not tried: the result is
  // the same whenever the best draft scores above `bar`.
  void speculate_into(const int32_t* ctx, size_t n, const SpecParams& p, DraftResult* out,
                      double bar = 0.0) const;
  void speculate_self_into(int64_t seq_id, const SpecParams& p, DraftResult* out,
                           double bar = 0.0) const;

  // Throws std::logic_error describing the first broken invariant.
  void check_integrity() const;

  // Held by a call that reads the tree without the GIL; bindings.cc refuses to
  // mutate a pinned tree (a mutation would free what that call reads). Changed
  // only with the GIL held.
  void pin() const { ++pins_; }
  void unpin() const { --pins_; }
  bool pinned() const { return pins_ != 0; }

 private:
  struct Slot {
    int64_t id = -1;
    std::vector<int32_t> tokens;
    std::vector<Node*> active;  // active[d] = node where the suffix of depth d ends, d >= 1
    int32_t implicit_upto = -1; // suffixes starting at or before this index are in open leaves
    int64_t refs = 0;           // nodes whose ref_slot is this slot
    bool alive = false;
  };

  // Label length, start (in slot ref_slot) and tokens of a non-root node.
  int32_t len(const Node* n) const {
    if (n->open_depth < 0) return n->length;
    return std::min(slot_len_[n->ref_slot] - n->ref_pos, max_depth_ - n->open_depth);
  }
  int32_t label_start(const Node* n) const {
    return n->open_depth < 0 ? n->ref_pos - n->length : n->ref_pos;
  }
  const int32_t* label(const Node* n) const {
    return slot_data_[n->ref_slot] + label_start(n);
  }
  // Turns an open leaf into an ordinary (closed) node of its current length; its
  // owner's suffix that ended there becomes explicit again.
  void close(Node* n);
  // Explicit suffix depths of a growing sequence: 1 .. this.
  int32_t explicit_depth(const Slot& s) const {
    const int32_t n = static_cast<int32_t>(s.tokens.size());
    return std::min(n - 1 - s.implicit_upto, max_depth_ - 1);
  }
  Node* new_node();
  void release_if_empty();
  void free_node(Node* n);
  void set_ref(Node* n, uint32_t slot, int32_t end);
  void set_ref_slot(Node* n, uint32_t slot);
  void release_slot_ref(uint32_t slot);
  Node* find_child(const Node* n, int32_t token) const;
  void add_child(Node* parent, Node* child);
  void remove_last_child(Node* parent);
  void replace_child(Node* parent, Node* old_child, Node* new_child);
  void increment(Node* child);
  void decrement(Node* child);
  void absorb_parent(Node* c);
  Node* extend(uint32_t slot, Node* a, int32_t depth, int32_t token, int32_t pos);
  void append_token(uint32_t slot, int32_t token);
  uint32_t slot_for_append(int64_t seq_id);
  bool walk(const int32_t* path, size_t n, Position* out) const;
  void draft_from(Position start, int32_t depth, int32_t limit, const SpecParams& p,
                  DraftResult* out) const;
  // Drafts from a match of length k and keeps the draft in `best` if it scores higher.
  void offer(Position at, int32_t k, int32_t limit, const SpecParams& p, DraftResult* best) const;
  // Whether a draft of at most `limit` tokens from `at` (trie depth `depth`) cannot
  // score above `bar`: each of its tokens has a cumulative probability no higher
  // than the first token's (the best child; later factors are <= 1).
  bool cannot_beat(Position at, int32_t depth, int32_t limit, const SpecParams& p,
                   double bar) const;
  void draft_path(Position start, int32_t depth, int32_t limit, const SpecParams& p,
                  DraftResult* out) const;
  void draft_tree(Position start, int32_t depth, int32_t limit, const SpecParams& p,
                  DraftResult* out) const;
  int32_t limit_for(int32_t k, const SpecParams& p) const;
  void check_node(const Node* n, std::vector<int32_t>* path, size_t* num_nodes,
                  std::vector<int64_t>* slot_refs) const;

  // Nodes live in chunks owned by the tree (locality, and no allocator call per
  // node); freed nodes are destroyed and their storage reused.
  // Chunks double in size (16 .. 4096 nodes), so small trees stay small.
  struct alignas(Node) NodeStorage { unsigned char bytes[sizeof(Node)]; };
  std::vector<std::unique_ptr<NodeStorage[]>> chunks_;
  size_t chunk_size_ = 0;   // capacity of the last chunk
  size_t chunk_used_ = 0;   // nodes handed out from the last chunk
  size_t chunk_total_ = 0;  // capacity of all chunks
  std::vector<Node*> free_nodes_;

  int32_t max_depth_;
  Node* root_;
  std::vector<Slot> slots_;
  std::vector<const int32_t*> slot_data_;  // slots_[i].tokens.data(): one load less per label
  std::vector<int32_t> slot_len_;          // slots_[i].tokens.size(), for open leaves
  std::vector<uint32_t> free_slots_;
  std::unordered_map<int64_t, uint32_t> ids_;
  uint32_t removing_slot_ = UINT32_MAX;  // slot being removed: its tokens stay until the end
  size_t num_nodes_ = 0;
  int64_t num_tokens_ = 0;
  mutable int64_t pins_ = 0;
};

}  // namespace war
