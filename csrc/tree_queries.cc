// Suffix trie reads: walking paths, counts, matches, memory and integrity
// checks. Maintenance is in suffix_tree.cc, drafting in speculate.cc.
#include <algorithm>
#include <string>
#include <unordered_map>

#include "suffix_tree.h"

namespace war {

// ---------------------------------------------------------------- queries

int64_t SuffixTree::seq_len(int64_t seq_id) const {
  return static_cast<int64_t>(sequence(seq_id).size());
}

const std::vector<int32_t>& SuffixTree::sequence(int64_t seq_id) const {
  auto it = ids_.find(seq_id);
  if (it == ids_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(seq_id));
  return slots_[it->second].tokens;
}

bool SuffixTree::walk(const int32_t* path, size_t n, Position* out) const {
  Node* node = root_;
  int32_t off = 0;
  size_t i = 0;
  while (i < n) {
    Node* c = find_child(node, path[i]);
    if (c == nullptr) return false;
    const int32_t* lab = label(c);
    int32_t j = 0;
    const int32_t c_len = len(c);
    while (j < c_len && i < n) {
      if (lab[j] != path[i]) return false;
      ++i;
      ++j;
    }
    node = c;
    off = j;
  }
  out->node = node;
  out->offset = off;
  return true;
}

int32_t SuffixTree::count(const int32_t* path, size_t n) const {
  Position p;
  if (n == 0 || !walk(path, n, &p)) return 0;
  return p.node->count;
}

std::vector<std::pair<int32_t, int32_t>> SuffixTree::children(const int32_t* path,
                                                              size_t n) const {
  std::vector<std::pair<int32_t, int32_t>> out;
  Position p;
  if (!walk(path, n, &p)) return out;
  if (p.node != root_ && p.offset < len(p.node)) {
    out.emplace_back(label(p.node)[p.offset], p.node->count);
  } else {
    for (const Child& c : p.node->children) out.emplace_back(c.token, c.count);
  }
  return out;
}

int32_t SuffixTree::match_len(const int32_t* ctx, size_t n) const {
  // Existence is monotone in the match length. Matches are usually short:
  // gallop up from 1, then binary search the last step.
  const int32_t cap =
      static_cast<int32_t>(std::min<size_t>(n, static_cast<size_t>(max_depth_)));
  int32_t lo = 0;
  int32_t hi = cap;
  Position p;
  for (int32_t probe = 1; probe <= cap; probe *= 2) {
    if (!walk(ctx + n - probe, static_cast<size_t>(probe), &p)) {
      hi = probe - 1;
      break;
    }
    lo = probe;
  }
  while (lo < hi) {
    const int32_t mid = (lo + hi + 1) / 2;
    if (walk(ctx + n - mid, static_cast<size_t>(mid), &p)) lo = mid; else hi = mid - 1;
  }
  return lo;
}

size_t SuffixTree::memory_bytes() const {
  size_t bytes = sizeof(*this);
  std::vector<const Node*> stack{root_};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    bytes += n->children.capacity() * sizeof(Child);
    if (n->index)
      bytes += sizeof(*n->index) + n->index->bytes();
    for (const Child& c : n->children) stack.push_back(c.node);
  }
  bytes += chunk_total_ * sizeof(Node) + chunks_.capacity() * sizeof(void*) +
           free_nodes_.capacity() * sizeof(Node*);
  bytes += slots_.capacity() * sizeof(Slot) + free_slots_.capacity() * sizeof(uint32_t) +
           slot_data_.capacity() * sizeof(const int32_t*) + slot_len_.capacity() * sizeof(int32_t);
  for (const Slot& s : slots_)
    bytes += s.tokens.capacity() * sizeof(int32_t) + s.active.capacity() * sizeof(Node*);
  bytes += ids_.bucket_count() * sizeof(void*) +
           ids_.size() * (sizeof(std::pair<const int64_t, uint32_t>) + 2 * sizeof(void*));
  return bytes;
}

// ---------------------------------------------------------------- integrity

void SuffixTree::check_node(const Node* n, std::vector<int32_t>* path, size_t* num_nodes,
                            std::vector<int64_t>* slot_refs) const {
  ++*num_nodes;
  const int32_t depth = static_cast<int32_t>(path->size());
  if (depth > max_depth_) fail("node deeper than max_depth");
  if (n != root_) {
    if (n->count < 1) fail("node with count < 1");
    if (n->ref_slot >= slots_.size()) fail("bad ref slot");
    const Slot& s = slots_[n->ref_slot];
    ++(*slot_refs)[n->ref_slot];
    if (len(n) < 1) fail("node with empty label");
    if (n->open_depth >= 0) {
      if (n->count != 1 || !n->children.empty()) fail("open node that is not a lone leaf");
      if (!s.alive) fail("open leaf of a removed sequence");
      if (n->open_depth != depth - len(n)) fail("open leaf's start depth out of date");
    }
    const int32_t end = label_start(n) + len(n);
    if (end > static_cast<int32_t>(s.tokens.size()) || end - depth < 0)
      fail("ref out of range");
    if (!std::equal(path->begin(), path->end(), s.tokens.begin() + (end - depth)))
      fail("ref does not hold the node's path");
    if (label(n)[0] != n->token) fail("token is not the label's first token");
  }
  int64_t child_sum = 0;
  for (size_t i = 0; i < n->children.size(); ++i) {
    const Node* c = n->children[i].node;
    if (c->parent != n) fail("bad parent pointer");
    if (c->pos != i) fail("bad child position");
    if (n->children[i].token != c->token || n->children[i].count != c->count)
      fail("child list entry out of date");
    if (i > 0 && n->children[i - 1].count < c->count) fail("children not sorted by count");
    for (size_t j = 0; j < i; ++j)
      if (n->children[j].token == c->token) fail("duplicate child token");
    if (find_child(n, c->token) != c) fail("child index out of date");
    child_sum += c->count;
  }
  if (n->index && n->index->size() != n->children.size()) fail("child index size");
  if (child_sum != n->child_sum) fail("child_sum out of date");
  if (n != root_) {
    if (child_sum > n->count) fail("children count more than their parent");
    if (n->children.size() == 1 && n->children[0].count == n->count)
      fail("uncompressed chain (parent and only child with equal count)");
  }
  for (const Child& e : n->children) {
    const Node* c = e.node;
    const int32_t* lab = label(c);
    path->insert(path->end(), lab, lab + len(c));
    check_node(c, path, num_nodes, slot_refs);
    path->resize(static_cast<size_t>(depth));
  }
}

void SuffixTree::check_integrity() const {
  size_t nodes = 0;
  std::vector<int64_t> slot_refs(slots_.size(), 0);
  std::vector<int32_t> path;
  check_node(root_, &path, &nodes, &slot_refs);
  if (nodes != num_nodes_ + 1) fail("node count out of date");
  int64_t live_tokens = 0;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    if (slot_refs[i] != s.refs) fail("slot reference count out of date");
    if (s.alive) {
      auto it = ids_.find(s.id);
      if (it == ids_.end() || it->second != i) fail("live slot missing from the id map");
      live_tokens += static_cast<int64_t>(s.tokens.size());
    } else if (s.refs == 0 && !s.tokens.empty()) {
      fail("dead, unreferenced slot still holds tokens");
    }
  }
  if (live_tokens != num_tokens_) fail("token count out of date");
  // Recount every node from the live sequences, by brute force.
  std::unordered_map<const Node*, int64_t> counted;
  for (const auto& [id, slot] : ids_) {
    const Slot& s = slots_[slot];
    const int32_t n = static_cast<int32_t>(s.tokens.size());
    for (int32_t i = 0; i < n; ++i) {
      const int32_t suffix_len = std::min(max_depth_, n - i);
      const Node* node = root_;
      int32_t depth = 0;
      while (depth < suffix_len) {
        const Node* c = find_child(node, s.tokens[i + depth]);
        if (c == nullptr) fail("a suffix of sequence " + std::to_string(id) + " is missing");
        const int32_t c_len = len(c);
        for (int32_t j = 0; j < c_len && depth + j < suffix_len; ++j)
          if (label(c)[j] != s.tokens[i + depth + j]) fail("a suffix's tokens differ");
        if (depth + c_len > suffix_len) fail("a suffix ends inside a node");
        depth += c_len;
        ++counted[c];
        node = c;
      }
      if (!s.active.empty() && i <= s.implicit_upto && i + max_depth_ > n &&
          (node->open_depth < 0 || node->ref_slot != slot))
        fail("a suffix in the implicit range does not end in its own open leaf");
    }
    if (!s.active.empty()) {
      for (int32_t d = 1; d <= explicit_depth(s); ++d) {
        Position p;
        if (!walk(s.tokens.data() + n - d, static_cast<size_t>(d), &p) ||
            p.node != s.active[d] || p.offset != len(p.node) || p.node->open_depth >= 0)
          fail("active suffix pointer out of date");
      }
    }
  }
  std::vector<const Node*> stack{root_};
  while (!stack.empty()) {
    const Node* n = stack.back();
    stack.pop_back();
    if (n != root_) {
      auto it = counted.find(n);
      const int64_t want = it == counted.end() ? 0 : it->second;
      if (want != n->count)
        fail("count " + std::to_string(n->count) + " != recount " + std::to_string(want));
    }
    for (const Child& c : n->children) stack.push_back(c.node);
  }
}

}  // namespace war
