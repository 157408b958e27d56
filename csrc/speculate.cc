// Drafting: path and tree drafts from a match, best over match lengths, and the
// batched choice among sources or merge of them. Semantics: docs/suffix-speculation.md.
#include "speculate.h"

#include <algorithm>
#include <cmath>
#include <queue>
#include <vector>

namespace war {

int32_t SuffixTree::limit_for(int32_t k, const SpecParams& p) const {
  const double x = std::floor(static_cast<double>(k) * p.factor + p.offset);
  if (!(x > 0.0)) return 0;
  if (x >= static_cast<double>(p.max_tokens)) return p.max_tokens;
  return static_cast<int32_t>(x);
}

namespace {
// The conditional probability of the next token (docs: section 2) inside a node's
// label (the node's own occurrences all continue with it) and at a child.
inline double label_prob(const Node* n, const SpecParams& p, int32_t depth) {
  return static_cast<double>(n->count) / (static_cast<double>(n->count) + p.alpha[depth]);
}
inline double child_prob(const Node* parent, const Child& c, const SpecParams& p, int32_t depth) {
  return static_cast<double>(c.count) / (static_cast<double>(parent->child_sum) + p.alpha[depth]);
}
}  // namespace

void SuffixTree::draft_path(Position at, int32_t depth, int32_t limit, const SpecParams& p,
                            DraftResult* out) const {
  Node* cur = at.node;
  int32_t off = at.offset;
  double p_cum = 1.0;
  int32_t parent = -1;
  while (static_cast<int32_t>(out->tokens.size()) < limit) {
    int32_t token;
    double prob;
    if (off < len(cur)) {
      token = label(cur)[off];
      prob = label_prob(cur, p, depth);
      ++off;
    } else {
      if (cur->children.empty()) break;
      const Child& c = cur->children[0];
      token = c.token;
      prob = child_prob(cur, c, p, depth);
      cur = c.node;
      off = 1;
    }
    ++depth;
    p_cum = p_cum * prob;
    if (p_cum < p.min_prob) break;
    out->tokens.push_back(token);
    out->parents.push_back(parent);
    out->probs.push_back(p_cum);
    out->score += p_cum;
    parent = static_cast<int32_t>(out->tokens.size()) - 1;
  }
}

namespace {
// A candidate token: emitting it moves to (node, off); off == 1 means it is the
// first token of `node`'s label, chosen from its parent's child list.
struct Candidate {
  double p_cum;
  uint64_t order;    // push order: ties go to the earlier push
  Node* node;
  int32_t off;
  int32_t parent;    // draft index of the token it follows (-1 = the context)
  int32_t depth;     // trie depth after emitting it
  double p_cum_up;   // cumulative probability where the choice was made
};
struct Worse {
  bool operator()(const Candidate& a, const Candidate& b) const {
    if (a.p_cum != b.p_cum) return a.p_cum < b.p_cum;
    return a.order > b.order;
  }
};
}  // namespace

void SuffixTree::draft_tree(Position at, int32_t depth, int32_t limit, const SpecParams& p,
                            DraftResult* out) const {
  thread_local std::vector<Candidate> heap_storage;
  heap_storage.clear();
  struct Heap {
    std::vector<Candidate>& v;
    bool empty() const { return v.empty(); }
    void push(const Candidate& c) { v.push_back(c); std::push_heap(v.begin(), v.end(), Worse()); }
    const Candidate& top() const { return v.front(); }
    void pop() { std::pop_heap(v.begin(), v.end(), Worse()); v.pop_back(); }
  } heap{heap_storage};
  uint64_t order = 0;
  auto push_first = [&](Node* cur, int32_t off, int32_t d, double p_here, int32_t parent) {
    if (off < len(cur)) {
      const double pc = p_here * label_prob(cur, p, d);
      if (pc >= p.min_prob) heap.push({pc, order++, cur, off + 1, parent, d + 1, p_here});
    } else if (!cur->children.empty()) {
      const Child& c = cur->children[0];
      const double pc = p_here * child_prob(cur, c, p, d);
      if (pc >= p.min_prob) heap.push({pc, order++, c.node, 1, parent, d + 1, p_here});
    }
  };
  push_first(at.node, at.offset, depth, 1.0, -1);
  while (!heap.empty() && static_cast<int32_t>(out->tokens.size()) < limit) {
    const Candidate x = heap.top();
    heap.pop();
    const int32_t idx = static_cast<int32_t>(out->tokens.size());
    out->tokens.push_back(x.off == 1 ? x.node->token : label(x.node)[x.off - 1]);
    out->parents.push_back(x.parent);
    out->probs.push_back(x.p_cum);
    out->score += x.p_cum;
    if (x.off == 1) {
      const Node* u = x.node->parent;
      if (x.node->pos + 1 < u->children.size()) {
        const Child& s = u->children[x.node->pos + 1];
        const double pc = x.p_cum_up * child_prob(u, s, p, x.depth - 1);
        if (pc >= p.min_prob) heap.push({pc, order++, s.node, 1, x.parent, x.depth, x.p_cum_up});
      }
    }
    push_first(x.node, x.off, x.depth, x.p_cum, idx);
  }
}

void SuffixTree::draft_from(Position at, int32_t depth, int32_t limit, const SpecParams& p,
                            DraftResult* out) const {
  if (p.tree) draft_tree(at, depth, limit, p, out); else draft_path(at, depth, limit, p, out);
}

namespace {
void reset(DraftResult* d) {
  d->tokens.clear();
  d->parents.clear();
  d->probs.clear();
  d->score = 0.0;
  d->match_len = 0;
}
}  // namespace

void SuffixTree::offer(Position at, int32_t k, int32_t limit, const SpecParams& p,
                       DraftResult* best) const {
  thread_local DraftResult cand;  // reused: no allocation per match length
  reset(&cand);
  draft_from(at, k, limit, p, &cand);
  if (cand.score > best->score) {
    std::swap(*best, cand);
    best->match_len = k;
  }
}

namespace {
// Skips a match length k whose string occurs exactly as often as the last longer
// match length r tried (docs: section 3). Every occurrence of the longer string
// ends with the shorter one, so equal counts mean the same occurrences: up to
// max_depth - r tokens after them (which covers r's draft limit, so also k's
// smaller one) the two positions have the same continuations with the same counts
// and child orders. With alpha not growing with depth each of k's probabilities is
// at most r's, computed the same way; k's draft (a chain along the same first
// children, or a tree of the highest cumulative probabilities, emitted in
// decreasing order) then sums terms no larger than r's, no more of them, in the
// same order, so it scores no higher even in floating point, and ties go to the
// longer match.
struct SameOccurrences {
  int32_t count = -1;   // count at the last match length tried
  bool covers = false;  // its draft limit fits in its continuation window
  bool skip(int32_t c, int32_t k, int32_t limit, int32_t max_depth, const SpecParams& p) {
    if (covers && c == count) return true;
    count = c;
    covers = p.alpha_nonincreasing && limit <= max_depth - k;
    return false;
  }
};
}  // namespace

bool SuffixTree::cannot_beat(Position at, int32_t depth, int32_t limit, const SpecParams& p,
                             double bar) const {
  const Node* cur = at.node;
  double first;
  if (at.offset < len(cur)) {
    first = label_prob(cur, p, depth);
  } else if (!cur->children.empty()) {
    first = child_prob(cur, cur->children[0], p, depth);
  } else {
    return true;  // nothing follows: the empty draft
  }
  if (first < p.min_prob) return true;  // the first token is cut: the empty draft
  // A draft's score is a sum of at most `limit` terms, each <= first; the slack
  // covers the rounding of that sum, so a draft skipped here could not have won.
  return static_cast<double>(limit) * first * (1.0 + 1e-9) <= bar;
}

void SuffixTree::speculate_into(const int32_t* ctx, size_t n, const SpecParams& p,
                                DraftResult* best, double bar) const {
  reset(best);
  const int32_t cap = static_cast<int32_t>(std::min<size_t>(n, static_cast<size_t>(max_depth_)));
  if (static_cast<double>(limit_for(cap, p)) <= bar) return;  // nothing here can win
  const int32_t max_k = match_len(ctx, n);
  SameOccurrences same;
  for (int32_t k = max_k; k >= 1; --k) {
    const int32_t limit = limit_for(k, p);
    if (static_cast<double>(limit) <= std::max(best->score, bar)) break;
    Position at;
    walk(ctx + n - k, static_cast<size_t>(k), &at);
    if (same.skip(at.node->count, k, limit, max_depth_, p)) continue;
    if (cannot_beat(at, k, limit, p, std::max(best->score, bar))) continue;
    offer(at, k, limit, p, best);
  }
}

void SuffixTree::speculate_self_into(int64_t seq_id, const SpecParams& p, DraftResult* best,
                                     double bar) const {
  auto it = ids_.find(seq_id);
  if (it == ids_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(seq_id));
  const Slot& s = slots_[it->second];
  if (s.active.empty()) {
    speculate_into(s.tokens.data(), s.tokens.size(), p, best, bar);
    return;
  }
  reset(best);
  // Only a suffix seen at least twice can have continued; that is monotone in
  // the depth (a longer string occurs no more often), so binary search the
  // deepest such suffix. The suffix of depth max_depth never continues.
  int32_t lo = 0;
  int32_t hi = explicit_depth(s);  // deeper suffixes are in open leaves: seen once
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (s.active[mid]->count >= 2) lo = mid; else hi = mid - 1;
  }
  SameOccurrences same;
  for (int32_t k = lo; k >= 1; --k) {
    const int32_t limit = limit_for(k, p);
    if (static_cast<double>(limit) <= std::max(best->score, bar)) break;
    Node* node = s.active[k];
    if (same.skip(node->count, k, limit, max_depth_, p)) continue;
    const Position at{node, len(node)};
    if (cannot_beat(at, k, limit, p, std::max(best->score, bar))) continue;  // e.g. nothing follows
    offer(at, k, limit, p, best);
  }
}

DraftResult SuffixTree::speculate(const int32_t* ctx, size_t n, const SpecParams& p) const {
  DraftResult best;
  speculate_into(ctx, n, p, &best);
  return best;
}

DraftResult SuffixTree::speculate_self(int64_t seq_id, const SpecParams& p) const {
  DraftResult best;
  speculate_self_into(seq_id, p, &best);
  return best;
}

namespace {

// One node of a merge: a token path from the context, named by its first
// appearance (sources in order group, local, global, each in emission order).
struct MergeNode {
  int32_t token;
  int32_t parent;       // merge node of the path without its last token (-1 = root)
  int32_t depth;        // path length
  int32_t first_child;  // children in order of first appearance
  int32_t last_child;
  int32_t next_sibling;
  double prod;          // product over contributing sources of (1 - term)
  double value;         // 1 - prod
  double best_term;     // the largest term, from source best_src
  int8_t best_src;
  int32_t best_match;   // match length of that source's draft
};

struct Merger {
  std::vector<MergeNode> nodes;
  std::vector<int32_t> map;  // draft index -> merge node
  int32_t root_first = -1, root_last = -1;

  void clear() {
    nodes.clear();
    root_first = root_last = -1;
  }

  // Adds a source's draft: each token's term min(1, weight * p_cum) multiplies
  // its path's prod by (1 - term).
  void add(const DraftResult& d, double weight, Source src) {
    map.resize(d.tokens.size());
    for (size_t i = 0; i < d.tokens.size(); ++i) {
      const int32_t parent = d.parents[i] < 0 ? -1 : map[d.parents[i]];
      int32_t c = parent < 0 ? root_first : nodes[parent].first_child;
      while (c >= 0 && nodes[c].token != d.tokens[i]) c = nodes[c].next_sibling;
      if (c < 0) {
        c = static_cast<int32_t>(nodes.size());
        const int32_t depth = parent < 0 ? 1 : nodes[parent].depth + 1;
        nodes.push_back({d.tokens[i], parent, depth, -1, -1, -1, 1.0, 0.0, -1.0,
                         static_cast<int8_t>(Source::kNone), 0});
        int32_t& last = parent < 0 ? root_last : nodes[parent].last_child;
        if (last < 0) {
          (parent < 0 ? root_first : nodes[parent].first_child) = c;
        } else {
          nodes[last].next_sibling = c;
        }
        last = c;
      }
      MergeNode& m = nodes[c];
      const double term = std::min(1.0, weight * d.probs[i]);
      m.prod = m.prod * (1.0 - term);
      if (term > m.best_term) {
        m.best_term = term;
        m.best_src = static_cast<int8_t>(src);
        m.best_match = d.match_len;
      }
      map[i] = c;
    }
  }
};

// Writes the merged draft (section 6) into `out` (its match_len: that of the
// source with the largest term on the first token); returns that source.
Source merged_draft(Merger& mg, bool tree, int32_t limit, double threshold, DraftResult* out) {
  reset(out);
  thread_local std::vector<int32_t> order, emitted;
  for (MergeNode& m : mg.nodes) m.value = 1.0 - m.prod;
  int32_t first = -1;
  if (tree) {
    order.clear();
    for (int32_t i = 0; i < static_cast<int32_t>(mg.nodes.size()); ++i)
      if (mg.nodes[i].value >= threshold) order.push_back(i);
    std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
      const MergeNode& x = mg.nodes[a];
      const MergeNode& y = mg.nodes[b];
      if (x.value != y.value) return x.value > y.value;
      if (x.depth != y.depth) return x.depth < y.depth;
      return a < b;
    });
    emitted.assign(mg.nodes.size(), -1);
    for (int32_t i : order) {
      if (static_cast<int32_t>(out->tokens.size()) >= limit) break;
      const MergeNode& m = mg.nodes[i];
      if (m.parent >= 0 && emitted[m.parent] < 0) continue;  // its parent was not kept
      if (first < 0) first = i;
      emitted[i] = static_cast<int32_t>(out->tokens.size());
      out->tokens.push_back(m.token);
      out->parents.push_back(m.parent < 0 ? -1 : emitted[m.parent]);
      out->probs.push_back(m.value);
      out->score += m.value;
    }
  } else {
    int32_t c = mg.root_first;  // the first child of the chain's end
    while (static_cast<int32_t>(out->tokens.size()) < limit && c >= 0) {
      int32_t best = c;
      for (int32_t s = mg.nodes[c].next_sibling; s >= 0; s = mg.nodes[s].next_sibling)
        if (mg.nodes[s].value > mg.nodes[best].value) best = s;
      const MergeNode& m = mg.nodes[best];
      if (!(m.value >= threshold)) break;
      if (first < 0) first = best;
      out->parents.push_back(static_cast<int32_t>(out->tokens.size()) - 1);
      out->tokens.push_back(m.token);
      out->probs.push_back(m.value);
      out->score += m.value;
      c = m.first_child;
    }
  }
  if (first < 0) return Source::kNone;
  out->match_len = mg.nodes[first].best_match;
  return static_cast<Source>(mg.nodes[first].best_src);
}

}  // namespace

void propose_batch(const std::vector<BatchItem>& items, const SuffixTree* global,
                   const SpecParams (&params)[3], double group_weight, const MergeParams& merge,
                   BatchResult* out) {
  out->offsets.assign(1, 0);
  DraftResult best, cand;
  Merger mg;
  for (const BatchItem& item : items) {
    SpecParams p[3] = {params[0], params[1], params[2]};
    for (SpecParams& q : p) q.max_tokens = std::min(q.max_tokens, item.budget);
    reset(&best);
    Source source = Source::kNone;
    if (p[0].max_tokens > 0) {
      const std::vector<int32_t>& seq = item.local->sequence(item.seq_id);
      const size_t ctx_len =
          std::min(seq.size(), static_cast<size_t>(item.local->max_depth()));
      const int32_t* ctx = seq.data() + (seq.size() - ctx_len);
      const bool use_group = group_weight > 0.0 && item.group->num_seqs() > 0;
      const bool use_global = global != nullptr && global->num_seqs() > 0;
      if (merge.enabled) {
        // Section 6: every source drafts a tree with the merge's cut; the drafts
        // merge by token path.
        for (SpecParams& q : p) {
          q.tree = true;
          q.min_prob = merge.min_prob;
        }
        mg.clear();
        if (use_group) {
          item.group->speculate_into(ctx, ctx_len, p[0], &cand, 0.0);
          mg.add(cand, group_weight, Source::kGroup);
        }
        item.local->speculate_self_into(item.seq_id, p[1], &cand, 0.0);
        mg.add(cand, 1.0, Source::kLocal);
        if (use_global) {
          global->speculate_into(ctx, ctx_len, p[2], &cand, 0.0);
          mg.add(cand, 1.0, Source::kGlobal);
        }
        source = merged_draft(mg, params[0].tree, p[0].max_tokens, merge.threshold, &best);
      } else {
        double best_weighted = 0.0;
        auto consider = [&](double weight, Source src) {
          const double w = cand.score * weight;
          if (w > best_weighted) {
            best_weighted = w;
            std::swap(best, cand);
            source = src;
          }
        };
        // A source wins only with a weighted score above the best so far: that
        // bar lets each source stop trying match lengths early (same result).
        if (use_group) {
          item.group->speculate_into(ctx, ctx_len, p[0], &cand, 0.0);
          consider(group_weight, Source::kGroup);
        }
        item.local->speculate_self_into(item.seq_id, p[1], &cand, best_weighted);
        consider(1.0, Source::kLocal);
        if (use_global) {
          global->speculate_into(ctx, ctx_len, p[2], &cand, best_weighted);
          consider(1.0, Source::kGlobal);
        }
      }
    }
    if (source == Source::kNone) reset(&best);
    out->tokens.insert(out->tokens.end(), best.tokens.begin(), best.tokens.end());
    out->parents.insert(out->parents.end(), best.parents.begin(), best.parents.end());
    out->probs.insert(out->probs.end(), best.probs.begin(), best.probs.end());
    out->offsets.push_back(static_cast<int64_t>(out->tokens.size()));
    out->scores.push_back(best.score);
    out->sources.push_back(static_cast<int8_t>(source));
    out->match_lens.push_back(best.match_len);
  }
}

}  // namespace war
