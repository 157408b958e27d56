// Suffix trie maintenance: append, remove, compression and counts. Reads and
// checks are in tree_queries.cc, drafting in speculate.cc; suffix_tree.h has the design.
#include "suffix_tree.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <new>
#include <string>

namespace war {

namespace {
constexpr size_t kIndexThreshold = 8;  // children beyond which a node keeps a hash index
constexpr uint32_t kNoSlot = std::numeric_limits<uint32_t>::max();
}  // namespace

SuffixTree::SuffixTree(int32_t max_depth) : max_depth_(max_depth) {
  if (max_depth < 1) throw std::invalid_argument("max_depth must be >= 1");
  root_ = new Node();  // outside the pool, so an empty tree can drop the pool
  root_->ref_slot = kNoSlot;
}

SuffixTree::~SuffixTree() {
  std::vector<Node*> stack;
  for (const Child& c : root_->children) stack.push_back(c.node);
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Child& c : n->children) stack.push_back(c.node);
    n->~Node();
  }
  delete root_;
}

// Once the last sequence is gone (zombies included), give every pooled buffer
// back, so that an emptied tree costs what a new one does.
void SuffixTree::release_if_empty() {
  if (num_nodes_ != 0 || !ids_.empty()) return;
  for (const Slot& s : slots_)
    if (s.refs != 0) return;
  chunks_.clear();
  chunks_.shrink_to_fit();
  chunk_size_ = chunk_used_ = chunk_total_ = 0;
  std::vector<Node*>().swap(free_nodes_);
  std::vector<Slot>().swap(slots_);
  std::vector<const int32_t*>().swap(slot_data_);
  std::vector<int32_t>().swap(slot_len_);
  std::vector<uint32_t>().swap(free_slots_);
  std::unordered_map<int64_t, uint32_t>().swap(ids_);
  std::vector<Child>().swap(root_->children);
  root_->index.reset();
  root_->child_sum = 0;
}

// ---------------------------------------------------------------- node helpers

Node* SuffixTree::new_node() {
  void* mem;
  if (!free_nodes_.empty()) {
    mem = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    if (chunk_used_ == chunk_size_) {
      chunk_size_ = chunk_size_ == 0 ? 16 : std::min<size_t>(chunk_size_ * 2, 4096);
      chunks_.emplace_back(new NodeStorage[chunk_size_]);
      chunk_total_ += chunk_size_;
      chunk_used_ = 0;
    }
    mem = &chunks_.back()[chunk_used_++];
  }
  Node* n = new (mem) Node();
  n->ref_slot = kNoSlot;
  ++num_nodes_;
  return n;
}

void SuffixTree::free_node(Node* n) {
  if (n->ref_slot != kNoSlot) release_slot_ref(n->ref_slot);
  n->~Node();
  free_nodes_.push_back(n);
  --num_nodes_;
}

void SuffixTree::set_ref_slot(Node* n, uint32_t slot) {
  if (n->ref_slot != slot) {
    if (n->ref_slot != kNoSlot) release_slot_ref(n->ref_slot);
    ++slots_[slot].refs;
    n->ref_slot = slot;
  }
}

// Points a closed node at the occurrence of its path ending at `end` in `slot`.
void SuffixTree::set_ref(Node* n, uint32_t slot, int32_t end) {
  set_ref_slot(n, slot);
  n->ref_pos = end;
}

void SuffixTree::release_slot_ref(uint32_t slot) {
  Slot& s = slots_[slot];
  --s.refs;
  if (s.refs == 0 && !s.alive && slot != removing_slot_) {
    std::vector<int32_t>().swap(s.tokens);
    slot_data_[slot] = nullptr;
    slot_len_[slot] = 0;
    s.id = -1;
    free_slots_.push_back(slot);
  }
}

Node* SuffixTree::find_child(const Node* n, int32_t token) const {
  if (n->index) return n->index->find(token);
  for (const Child& c : n->children)
    if (c.token == token) return c.node;
  return nullptr;
}

void SuffixTree::add_child(Node* parent, Node* child) {
  child->parent = parent;
  child->pos = static_cast<uint32_t>(parent->children.size());
  parent->children.push_back(Child{child->token, child->count, child});
  if (parent->index) {
    parent->index->put(child->token, child);
  } else if (parent->children.size() > kIndexThreshold) {
    parent->index = std::make_unique<FlatIndex>();
    for (const Child& c : parent->children) parent->index->put(c.token, c.node);
  }
}

void SuffixTree::remove_last_child(Node* parent) {
  const int32_t token = parent->children.back().token;
  parent->children.pop_back();
  if (parent->index) parent->index->erase(token);
}

// `new_child` takes `old_child`'s place; both have the same first token.
void SuffixTree::replace_child(Node* parent, Node* old_child, Node* new_child) {
  new_child->parent = parent;
  new_child->pos = old_child->pos;
  parent->children[old_child->pos] = Child{new_child->token, new_child->count, new_child};
  if (parent->index) parent->index->put(new_child->token, new_child);
}

// Count k -> k+1: swap with the first sibling of count k (docs: child order).
void SuffixTree::increment(Node* c) {
  auto& sib = c->parent->children;
  const int32_t k = c->count;
  size_t lo = 0, hi = c->pos;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (sib[mid].count > k) lo = mid + 1; else hi = mid;
  }
  if (lo != c->pos) {
    Node* other = sib[lo].node;
    std::swap(sib[lo], sib[c->pos]);
    other->pos = c->pos;
    c->pos = static_cast<uint32_t>(lo);
  }
  ++c->count;
  sib[c->pos].count = c->count;
  ++c->parent->child_sum;
}

// Count k -> k-1: swap with the last sibling of count k; drop the child at 0.
void SuffixTree::decrement(Node* c) {
  Node* parent = c->parent;
  auto& sib = parent->children;
  const int32_t k = c->count;
  size_t lo = c->pos, hi = sib.size() - 1;
  while (lo < hi) {
    size_t mid = (lo + hi + 1) / 2;
    if (sib[mid].count >= k) lo = mid; else hi = mid - 1;
  }
  if (lo != c->pos) {
    Node* other = sib[lo].node;
    std::swap(sib[lo], sib[c->pos]);
    other->pos = c->pos;
    c->pos = static_cast<uint32_t>(lo);
  }
  --c->count;
  sib[c->pos].count = c->count;
  --parent->child_sum;
  if (c->count == 0) remove_last_child(parent);
}

void SuffixTree::close(Node* n) {
  if (n->open_depth < 0) return;
  const int32_t length = len(n);
  const int32_t depth = n->open_depth + length;  // where the owner's suffix ends
  Slot& owner = slots_[n->ref_slot];
  n->length = length;
  n->ref_pos += length;
  n->open_depth = -1;
  if (depth < max_depth_ && !owner.active.empty()) {
    // Another occurrence is arriving, so this suffix is no longer unique. The
    // same step closes every shorter open suffix of the owner (the arriving
    // sequence ends with all of them), so the owner is consistent after it.
    owner.active[depth] = n;
    owner.implicit_upto = std::min(owner.implicit_upto, slot_len_[n->ref_slot] - depth - 1);
  }
}

// The parent of `c` has `c` as its only child and the same count: `c` takes over
// its label and its place. `c` survives, so pointers to it stay valid.
void SuffixTree::absorb_parent(Node* c) {
  Node* a = c->parent;
  if (c->open_depth >= 0) {
    c->ref_pos -= a->length;  // an open leaf's label starts earlier
    c->open_depth -= a->length;
  } else {
    c->length += a->length;
  }
  c->token = a->token;
  replace_child(a->parent, a, c);
  a->children.clear();
  free_node(a);
}

// ---------------------------------------------------------------- append

uint32_t SuffixTree::slot_for_append(int64_t seq_id) {
  auto it = ids_.find(seq_id);
  if (it != ids_.end()) {
    if (slots_[it->second].active.empty())
      throw std::invalid_argument("sequence " + std::to_string(seq_id) + " is sealed");
    return it->second;
  }
  uint32_t slot;
  if (!free_slots_.empty()) {
    slot = free_slots_.back();
    free_slots_.pop_back();
  } else {
    slot = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
    slot_data_.push_back(nullptr);
    slot_len_.push_back(0);
  }
  Slot& s = slots_[slot];
  s.id = seq_id;
  s.alive = true;
  s.refs = 0;
  s.tokens.clear();
  s.implicit_upto = -1;
  slot_data_[slot] = s.tokens.data();
  slot_len_[slot] = 0;
  s.active.assign(static_cast<size_t>(max_depth_), nullptr);
  s.active[0] = root_;
  ids_.emplace(seq_id, slot);
  return slot;
}

// Moves the suffix that ends at `a` (at trie depth `depth`) one token deeper and
// returns the node where it now ends. `pos` is the token's index in its sequence,
// already appended. A returned open leaf means the suffix now grows implicitly.
Node* SuffixTree::extend(uint32_t slot, Node* a, int32_t depth, int32_t token, int32_t pos) {
  if (a != root_ && a->children.empty() && a->count == 1) {
    // This suffix is the (closed) leaf's only occupant, so the leaf's path is
    // this suffix: open the leaf on this sequence, which grows it by the token.
    set_ref_slot(a, slot);
    a->ref_pos = pos - a->length;
    a->open_depth = depth - a->length;
    return a;
  }
  Node* c = find_child(a, token);
  if (c == nullptr) {
    c = new_node();
    c->token = token;
    c->count = 1;
    set_ref_slot(c, slot);
    c->ref_pos = pos;  // an open leaf: label = tokens[pos, end of sequence)
    c->open_depth = depth;
    add_child(a, c);
    ++a->child_sum;
    return c;
  }
  if (len(c) > 1) {
    // The suffix enters `c` by one token only: split off that token.
    Node* top = new_node();
    top->token = token;
    top->count = c->count;
    top->child_sum = c->count;
    top->length = 1;
    set_ref(top, c->ref_slot, label_start(c) + 1);
    replace_child(a, c, top);
    if (c->open_depth >= 0) {
      c->ref_pos += 1;
      c->open_depth += 1;
    } else {
      c->length -= 1;
    }
    c->token = label(c)[0];
    c->parent = top;
    c->pos = 0;
    top->children.push_back(Child{c->token, c->count, c});
    c = top;
  }
  close(c);  // it is about to hold two occurrences
  increment(c);
  set_ref(c, slot, pos + 1);
  if (a != root_ && a->children.size() == 1 && a->count == c->count) absorb_parent(c);
  return c;
}

void SuffixTree::append_token(uint32_t slot, int32_t token) {
  Slot& s = slots_[slot];
  const int32_t n = static_cast<int32_t>(s.tokens.size());
  const int32_t dmax = explicit_depth(s);
  s.tokens.push_back(token);
  slot_data_[slot] = s.tokens.data();
  slot_len_[slot] = n + 1;
  // Suffixes in open leaves grew with the push; the others move one token down,
  // longest first.
  for (int32_t d = dmax; d >= 0; --d) {
    Node* c = extend(slot, s.active[d], d, token, n);
    if (c->open_depth >= 0) {
      // This suffix and every longer one now grow implicitly.
      s.implicit_upto = std::max(s.implicit_upto, n - d);
    } else if (d + 1 < max_depth_) {
      s.active[d + 1] = c;
    }
  }
  ++num_tokens_;
}

void SuffixTree::append(int64_t seq_id, const int32_t* tokens, size_t n) {
  if (static_cast<int64_t>(n) > std::numeric_limits<int32_t>::max() / 2)
    throw std::invalid_argument("too many tokens in one append");
  const uint32_t slot = slot_for_append(seq_id);
  if (slots_[slot].tokens.size() + n > static_cast<size_t>(std::numeric_limits<int32_t>::max() / 2))
    throw std::invalid_argument("sequence " + std::to_string(seq_id) + " would exceed " +
                                std::to_string(std::numeric_limits<int32_t>::max() / 2) +
                                " tokens");
  std::vector<int32_t>& toks = slots_[slot].tokens;
  if (toks.capacity() < toks.size() + n) {
    // Geometric growth: a reserve of the exact size at every append would copy the
    // whole sequence on each call, quadratic in a trajectory appended a few tokens
    // at a time.
    toks.reserve(std::max(toks.size() + n, 2 * toks.capacity()));
  }
  slot_data_[slot] = toks.data();
  for (size_t i = 0; i < n; ++i) append_token(slot, tokens[i]);
}

void SuffixTree::append_from(int64_t seq_id, const SuffixTree& other, int64_t other_id,
                             int64_t start, int64_t end) {
  const std::vector<int32_t>& src = other.sequence(other_id);
  if (start < 0 || end < start || end > static_cast<int64_t>(src.size()))
    throw std::invalid_argument("append_from: range out of bounds");
  if (&other == this) {
    std::vector<int32_t> copy(src.begin() + start, src.begin() + end);
    append(seq_id, copy.data(), copy.size());
  } else {
    append(seq_id, src.data() + start, static_cast<size_t>(end - start));
  }
}

void SuffixTree::seal(int64_t seq_id) {
  auto it = ids_.find(seq_id);
  if (it == ids_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(seq_id));
  std::vector<Node*>().swap(slots_[it->second].active);
}

// ---------------------------------------------------------------- remove

void SuffixTree::remove(int64_t seq_id) {
  auto it = ids_.find(seq_id);
  if (it == ids_.end())
    throw std::invalid_argument("unknown sequence id " + std::to_string(seq_id));
  const uint32_t slot = it->second;
  ids_.erase(it);
  Slot& s = slots_[slot];
  s.alive = false;
  std::vector<Node*>().swap(s.active);
  removing_slot_ = slot;
  const std::vector<int32_t>& toks = s.tokens;  // kept until the end of this call
  const int32_t n = static_cast<int32_t>(toks.size());
  num_tokens_ -= n;
  std::vector<Node*> path;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t suffix_len = std::min(max_depth_, n - i);
    path.clear();
    Node* node = root_;
    int32_t depth = 0;
    while (depth < suffix_len) {
      Node* c = find_child(node, toks[i + depth]);
      if (c == nullptr) fail("remove: suffix path missing");
      depth += len(c);
      path.push_back(c);
      node = c;
    }
    if (depth != suffix_len) fail("remove: suffix ends inside a node");
    for (Node* c : path) decrement(c);
    for (size_t j = path.size(); j-- > 0;) {
      Node* c = path[j];
      if (c->count == 0) {
        if (!c->children.empty()) fail("remove: dead node has children");
        free_node(c);
        continue;
      }
      if (!slots_[c->ref_slot].alive) {
        // Re-point at a live occurrence of the same path, found through a child.
        for (const Child& e : c->children) {
          const Node* ch = e.node;
          if (slots_[ch->ref_slot].alive) {
            set_ref(c, ch->ref_slot, label_start(ch));
            break;
          }
        }
      }
      if (c->children.size() == 1 && c->children[0].count == c->count)
        absorb_parent(c->children[0].node);
    }
  }
  removing_slot_ = kNoSlot;
  if (s.refs == 0) {
    std::vector<int32_t>().swap(s.tokens);
    slot_data_[slot] = nullptr;
    slot_len_[slot] = 0;
    s.id = -1;
    free_slots_.push_back(slot);
  }
  release_if_empty();
}

}  // namespace war
