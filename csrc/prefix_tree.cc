// The multi-replica prefix tree (prefix_tree.h). Comments name the reference's
// functions (war/router/policies/prefix_tree_reference.py) each part mirrors.
#include "prefix_tree.h"

#include <algorithm>
#include <cmath>

namespace war::prefix {

namespace {

[[noreturn]] void fail(const std::string& what) { throw IntegrityError(what); }

// ---------------------------------------------------------------- heapq
// Python's heapq on a list, step for step (Lib/heapq.py's _siftdown/_siftup,
// which the C module implements with the same comparisons), so that the array
// layout, and with it the order in which compaction meets entries, is the
// reference's.

// Moves h[pos] up towards `start` while it is smaller than its parent.
void sift_down(std::vector<HeapEntry>& h, size_t start, size_t pos) {
  const HeapEntry item = h[pos];
  while (pos > start) {
    const size_t parent = (pos - 1) >> 1;
    if (!(item < h[parent])) break;
    h[pos] = h[parent];
    pos = parent;
  }
  h[pos] = item;
}

// Moves the smaller child up until h[pos]'s item reaches a leaf, then sifts
// the item back up (heapq's bottom-up variant: fewer comparisons).
void sift_up(std::vector<HeapEntry>& h, size_t pos) {
  const size_t end = h.size();
  const size_t start = pos;
  const HeapEntry item = h[pos];
  size_t child = 2 * pos + 1;
  while (child < end) {
    const size_t right = child + 1;
    if (right < end && !(h[child] < h[right])) child = right;
    h[pos] = h[child];
    pos = child;
    child = 2 * pos + 1;
  }
  h[pos] = item;
  sift_down(h, start, pos);
}

void heap_push(std::vector<HeapEntry>& h, const HeapEntry& e) {
  h.push_back(e);
  sift_down(h, 0, h.size() - 1);
}

HeapEntry heap_pop(std::vector<HeapEntry>& h) {
  const HeapEntry last = h.back();
  h.pop_back();
  if (h.empty()) return last;
  const HeapEntry top = h[0];
  h[0] = last;
  sift_up(h, 0);
  return top;
}

void heapify(std::vector<HeapEntry>& h) {
  for (size_t i = h.size() / 2; i-- > 0;) sift_up(h, i);
}

// Length of the common prefix of `key` and toks[0, n).
size_t common_len(const std::vector<Token>& key, const Token* toks, size_t n) {
  const size_t m = std::min(key.size(), n);
  return static_cast<size_t>(std::mismatch(key.begin(), key.begin() + static_cast<std::ptrdiff_t>(m), toks).first -
                             key.begin());
}

}  // namespace

// ---------------------------------------------------------------- ChildMap

size_t ChildMap::slot_of(Token t) const {
  const size_t mask = index_.size() - 1;
  size_t i = home(t);
  while (items_[static_cast<size_t>(index_[i])].token != t) i = (i + 1) & mask;
  return i;
}

void ChildMap::rebuild(size_t capacity) {
  index_.assign(capacity, -1);
  if (capacity == 0) {
    std::vector<int32_t>().swap(index_);
    return;
  }
  const size_t mask = capacity - 1;
  for (size_t p = 0; p < items_.size(); ++p) {
    size_t i = home(items_[p].token);
    while (index_[i] >= 0) i = (i + 1) & mask;
    index_[i] = static_cast<int32_t>(p);
  }
}

void ChildMap::put(Token t, int32_t node) {
  if (index_.empty()) {
    for (Item& it : items_)
      if (it.token == t) {
        it.node = node;
        return;
      }
    items_.push_back({t, node});
    if (items_.size() > kLinear) rebuild(64);
    return;
  }
  const size_t mask = index_.size() - 1;
  size_t i = home(t);
  for (; index_[i] >= 0; i = (i + 1) & mask) {
    Item& it = items_[static_cast<size_t>(index_[i])];
    if (it.token == t) {
      it.node = node;
      return;
    }
  }
  index_[i] = static_cast<int32_t>(items_.size());
  items_.push_back({t, node});
  if (2 * items_.size() > index_.size()) rebuild(2 * index_.size());  // load <= 1/2
}

void ChildMap::erase(Token t) {
  size_t p = 0;
  if (index_.empty()) {
    while (p < items_.size() && items_[p].token != t) ++p;
    if (p == items_.size()) return;
  } else {
    if (find(t) < 0) return;
    // Remove t's slot, shifting later entries of its probe run back (no tombstones).
    const size_t mask = index_.size() - 1;
    size_t hole = slot_of(t);
    p = static_cast<size_t>(index_[hole]);
    for (size_t j = (hole + 1) & mask; index_[j] >= 0; j = (j + 1) & mask) {
      const size_t h = home(items_[static_cast<size_t>(index_[j])].token);
      // Entry j may move into the hole unless its home lies cyclically in (hole, j].
      const bool stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
      if (!stays) {
        index_[hole] = index_[j];
        hole = j;
      }
    }
    index_[hole] = -1;
  }
  const size_t last = items_.size() - 1;
  if (p != last) {
    items_[p] = items_[last];
    if (!index_.empty()) index_[slot_of(items_[p].token)] = static_cast<int32_t>(p);
  }
  items_.pop_back();
  if (!index_.empty() && items_.size() <= kLinear / 2) rebuild(0);
}

void ChildMap::check() const {
  for (size_t a = 0; a < items_.size(); ++a)
    for (size_t b = a + 1; b < items_.size() && items_.size() <= 64; ++b)
      if (items_[a].token == items_[b].token) fail("duplicate child token");
  if (index_.empty()) {
    if (items_.size() > kLinear) fail("a large child map has no index");
    return;
  }
  size_t used = 0;
  for (int32_t p : index_)
    if (p >= 0) ++used;
  if (used != items_.size()) fail("child index size");
  for (const Item& it : items_)
    if (find(it.token) != it.node) fail("child index lookup");
}

// ---------------------------------------------------------------- tree

PrefixTree::PrefixTree(double budget) : budget_(budget) {
  nodes_.emplace_back();
  nodes_[0].live = true;
  nodes_[0].gen = next_gen_++;
}

void PrefixTree::ensure_replica(int32_t r) {
  if (r >= 0 && static_cast<size_t>(r) >= replicas_.size()) {
    replicas_.resize(static_cast<size_t>(r) + 1);
    match_slot_.resize(static_cast<size_t>(r) + 1, -1);
  }
}

const std::vector<HeapEntry>& PrefixTree::heap(int32_t r) const {
  static const std::vector<HeapEntry> kNone;
  return valid(r) ? replicas_[static_cast<size_t>(r)].heap : kNone;
}

int32_t PrefixTree::alloc() {
  int32_t i;
  if (!free_.empty()) {
    i = free_.back();
    free_.pop_back();
  } else {
    i = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = at(i);
  n.live = true;
  n.gen = next_gen_++;
  n.parent = -1;
  return i;
}

void PrefixTree::free_node(int32_t i) {
  Node& n = at(i);
  n.live = false;
  n.parent = -1;
  std::vector<Token>().swap(n.key);
  std::vector<Holder>().swap(n.holders);
  n.children.clear();
  free_.push_back(i);
}

void PrefixTree::free_subtree(int32_t top) {
  std::vector<int32_t> stack{top};
  while (!stack.empty()) {
    const int32_t i = stack.back();
    stack.pop_back();
    for (const ChildMap::Item& c : at(i).children.items()) stack.push_back(c.node);
    free_node(i);
  }
}

const Holder* PrefixTree::holder(int32_t i, int32_t r) const {
  for (const Holder& h : at(i).holders)
    if (h.replica == r) return &h;
  return nullptr;
}

// _touch (inlined in the reference's _insert_from)
void PrefixTree::touch(int32_t i, int32_t r, double now) {
  Node& n = at(i);
  for (Holder& h : n.holders)
    if (h.replica == r) {
      h.time = now;
      return;
    }
  n.holders.push_back({r, now});
  Replica& rep = replicas_[static_cast<size_t>(r)];
  rep.tokens += static_cast<int64_t>(n.key.size());
  rep.nodes += 1;
  rep.known = true;
}

// _is_leaf_of
bool PrefixTree::is_leaf_of(int32_t i, int32_t r) const {
  for (const ChildMap::Item& c : at(i).children.items())
    if (holder(c.node, r) != nullptr) return false;
  return true;
}

// The reference's test for a popped entry: `node.holders.get(replica) == t and
// _is_leaf_of(node, replica)`. A node freed since the push is one the
// reference detached: nobody it was pushed for holds it any more.
bool PrefixTree::valid_entry(const HeapEntry& e, int32_t r) const {
  const Node& n = at(e.node);
  if (!n.live || n.gen != e.gen) return false;
  const Holder* h = holder(e.node, r);
  return h != nullptr && h->time == e.time && is_leaf_of(e.node, r);
}

// _split: the old slot stays the lower node (the handle of a path end keeps
// ending the same path), a new upper node takes the first k tokens.
int32_t PrefixTree::split(int32_t i, size_t k) {
  if (k == 0 || k >= at(i).key.size()) fail("split inside the edge");
  const int32_t u = alloc();  // may move nodes_: no references held across it
  Node& node = at(i);
  Node& upper = at(u);
  const int32_t parent = node.parent;
  if (parent < 0) fail("the root is never split");
  upper.key.assign(node.key.begin(), node.key.begin() + static_cast<std::ptrdiff_t>(k));
  upper.holders = node.holders;
  upper.parent = parent;
  node.key.erase(node.key.begin(), node.key.begin() + static_cast<std::ptrdiff_t>(k));
  node.parent = u;
  upper.children.put(node.key[0], i);
  at(parent).children.put(upper.key[0], u);
  for (const Holder& h : upper.holders) replicas_[static_cast<size_t>(h.replica)].nodes += 1;
  return u;
}

// _drop
void PrefixTree::drop(int32_t i, int32_t r) {
  Node& n = at(i);
  auto it = std::find_if(n.holders.begin(), n.holders.end(),
                         [r](const Holder& h) { return h.replica == r; });
  n.holders.erase(it);  // keeps the others' order
  Replica& rep = replicas_[static_cast<size_t>(r)];
  rep.tokens -= static_cast<int64_t>(n.key.size());
  rep.nodes -= 1;
  if (n.holders.empty()) {
    if (!n.children.empty()) fail("a node nobody holds has no held children");
    if (n.parent < 0) fail("the root is never held");
    at(n.parent).children.erase(n.key[0]);
    free_node(i);
  }
}

// _push and _compact
bool PrefixTree::push(int32_t r, int32_t i, std::vector<HeapEntry>* replaced) {
  Replica& rep = replicas_[static_cast<size_t>(r)];
  const Holder* h = holder(i, r);
  heap_push(rep.heap, HeapEntry{h->time, seq_++, i, at(i).gen});
  if (static_cast<int64_t>(rep.heap.size()) <= 2 * rep.nodes + 64) return false;
  compact(r, replaced);
  return true;
}

void PrefixTree::compact(int32_t r, std::vector<HeapEntry>* replaced) {
  Replica& rep = replicas_[static_cast<size_t>(r)];
  const uint64_t mark = ++mark_;
  std::vector<HeapEntry> kept;
  for (const HeapEntry& e : rep.heap) {
    // valid, and the first entry of its node in array order
    if (valid_entry(e, r) && at(e.node).mark != mark) {
      at(e.node).mark = mark;
      kept.push_back(e);
    }
  }
  heapify(kept);
  if (replaced != nullptr) *replaced = std::move(rep.heap);
  rep.heap = std::move(kept);
}

// _insert_from
int32_t PrefixTree::insert_from(int32_t start, const Token* toks, size_t n, int32_t r,
                                double now, uint64_t* end_gen) {
  int32_t node = start;
  size_t pos = 0;
  while (pos < n) {
    const Token first = toks[pos];
    int32_t child = at(node).children.find(first);
    if (child < 0) {
      child = alloc();
      Node& c = at(child);
      c.key.assign(toks + pos, toks + n);
      c.parent = node;
      at(node).children.put(first, child);
      pos = n;
    } else {
      const std::vector<Token>& key = at(child).key;
      size_t k = key.size();
      if (n - pos < k || !std::equal(key.begin(), key.end(), toks + pos)) {
        k = common_len(key, toks + pos, n - pos);  // the edge does not match whole
        child = split(child, k);
      }
      pos += k;
    }
    touch(child, r, now);
    node = child;
  }
  *end_gen = at(node).gen;
  // the end of the path: a leaf of r unless r holds something deeper
  if (node != 0) push(r, node, nullptr);
  if (static_cast<double>(replicas_[static_cast<size_t>(r)].tokens) > budget_) evict(r, budget_);
  return node;
}

Handle PrefixTree::insert(const Token* toks, size_t n, int32_t r, double now) {
  ensure_replica(r);
  uint64_t gen = 0;
  const int32_t end = insert_from(0, toks, n, r, now, &gen);
  return Handle{end, gen};
}

Handle PrefixTree::extend(const Handle& end, const Token* toks, size_t n, int32_t r, double now) {
  ensure_replica(r);
  // touches root..end (order is unobservable: no pushes on the way)
  for (int32_t i = end.node; i != 0; i = at(i).parent) touch(i, r, now);
  uint64_t gen = 0;
  const int32_t e = insert_from(end.node, toks, n, r, now, &gen);
  return Handle{e, gen};
}

// evict
int64_t PrefixTree::evict(int32_t r, double max_tokens) {
  if (!valid(r)) return 0;
  Replica& rep = replicas_[static_cast<size_t>(r)];
  const int64_t before = rep.tokens;
  // The reference pops the list it fetched first, also after a push below has
  // compacted the replica's heap into a new list: then `work` is that old list,
  // kept in `old`, while pushes go to the replica's current heap.
  std::vector<HeapEntry> old;
  std::vector<HeapEntry>* work = &rep.heap;
  while (static_cast<double>(rep.tokens) > max_tokens && !work->empty()) {
    const HeapEntry e = heap_pop(*work);
    if (!valid_entry(e, r)) continue;  // stale: touched since, evicted, or not a leaf
    const int32_t parent = at(e.node).parent;
    drop(e.node, r);
    if (parent > 0 && is_leaf_of(parent, r)) {
      // A compaction of the heap being popped detaches it: keep popping it as `old`.
      // Later compactions replace lists that nobody pops.
      if (push(r, parent, work == &rep.heap ? &old : nullptr)) work = &old;
    }
  }
  return before - rep.tokens;
}

// remove_replica
void PrefixTree::remove_replica(int32_t r) {
  if (!valid(r)) return;
  std::vector<int32_t> stack;
  for (const ChildMap::Item& c : at(0).children.items())
    if (holder(c.node, r) != nullptr) stack.push_back(c.node);
  while (!stack.empty()) {
    const int32_t i = stack.back();
    stack.pop_back();
    Node& n = at(i);
    n.holders.erase(std::find_if(n.holders.begin(), n.holders.end(),
                                 [r](const Holder& h) { return h.replica == r; }));
    if (n.holders.empty()) {  // its descendants were held by r at most
      at(n.parent).children.erase(n.key[0]);
      free_subtree(i);
      continue;
    }
    for (const ChildMap::Item& c : n.children.items())
      if (holder(c.node, r) != nullptr) stack.push_back(c.node);
  }
  Replica& rep = replicas_[static_cast<size_t>(r)];
  rep.tokens = 0;
  rep.nodes = 0;
  rep.known = false;
  std::vector<HeapEntry>().swap(rep.heap);
}

// match
void PrefixTree::match(const Token* toks, size_t n,
                       std::vector<std::pair<int32_t, int64_t>>* out) {
  out->clear();
  int32_t node = 0;
  size_t pos = 0;
  while (pos < n) {
    const int32_t child = at(node).children.find(toks[pos]);
    if (child < 0) break;
    const Node& c = at(child);
    const size_t k = common_len(c.key, toks + pos, n - pos);
    const auto len = static_cast<int64_t>(pos + k);
    for (const Holder& h : c.holders) {
      int64_t& slot = match_slot_[static_cast<size_t>(h.replica)];
      if (slot < 0) {
        slot = static_cast<int64_t>(out->size());
        out->emplace_back(h.replica, len);
      } else {
        (*out)[static_cast<size_t>(slot)].second = len;
      }
    }
    if (k < c.key.size()) break;
    node = child;
    pos += k;
  }
  for (const auto& o : *out) match_slot_[static_cast<size_t>(o.first)] = -1;
}

void PrefixTree::dump(std::vector<std::pair<std::vector<Token>, std::vector<Holder>>>* out) const {
  std::vector<std::pair<int32_t, std::vector<Token>>> stack{{0, {}}};
  while (!stack.empty()) {
    auto [i, path] = std::move(stack.back());
    stack.pop_back();
    for (const ChildMap::Item& c : at(i).children.items()) {
      std::vector<Token> p = path;
      p.insert(p.end(), at(c.node).key.begin(), at(c.node).key.end());
      out->emplace_back(p, at(c.node).holders);
      stack.emplace_back(c.node, std::move(p));
    }
  }
}

void PrefixTree::check_integrity() const {
  const Node& root = at(0);
  if (!root.live || root.parent != -1 || !root.key.empty() || !root.holders.empty())
    fail("root");
  std::vector<int64_t> tokens(replicas_.size(), 0), nodes(replicas_.size(), 0);
  size_t reached = 1;
  std::vector<int32_t> stack{0};
  while (!stack.empty()) {
    const int32_t i = stack.back();
    stack.pop_back();
    const Node& n = at(i);
    n.children.check();
    for (const ChildMap::Item& c : n.children.items()) {
      if (c.node <= 0 || static_cast<size_t>(c.node) >= nodes_.size()) fail("child index");
      const Node& ch = at(c.node);
      if (!ch.live) fail("a child is a freed node");
      if (ch.key.empty() || ch.key[0] != c.token) fail("child keyed by its first token");
      if (ch.parent != i) fail("parent link");
      if (ch.holders.empty()) fail("every non-root node is held by someone");
      for (size_t a = 0; a < ch.holders.size(); ++a) {
        const int32_t r = ch.holders[a].replica;
        if (!valid(r)) fail("holder is not a replica");
        if (std::isnan(ch.holders[a].time)) fail("touch time is NaN");
        for (size_t b = a + 1; b < ch.holders.size(); ++b)
          if (ch.holders[b].replica == r) fail("a replica holds a node twice");
        if (i != 0 && holder(i, r) == nullptr) fail("a replica holding a node holds its parent");
        tokens[static_cast<size_t>(r)] += static_cast<int64_t>(ch.key.size());
        nodes[static_cast<size_t>(r)] += 1;
      }
      ++reached;
      stack.push_back(c.node);
    }
  }
  size_t live = 0;
  for (const Node& n : nodes_)
    if (n.live) ++live;
  if (live != reached) fail("live nodes unreachable from the root");
  if (live + free_.size() != nodes_.size()) fail("free list");
  for (int32_t f : free_)
    if (at(f).live) fail("a free slot is live");
  for (size_t r = 0; r < replicas_.size(); ++r) {
    const Replica& rep = replicas_[r];
    if (rep.tokens != tokens[r])
      fail("token count of replica " + std::to_string(r) + ": " + std::to_string(rep.tokens) +
           " != " + std::to_string(tokens[r]));
    if (rep.nodes != nodes[r])
      fail("node count of replica " + std::to_string(r) + ": " + std::to_string(rep.nodes) +
           " != " + std::to_string(nodes[r]));
    if (!rep.known && (rep.tokens != 0 || !rep.heap.empty())) fail("unknown replica holds");
    for (size_t k = 0; k < rep.heap.size(); ++k) {
      const HeapEntry& e = rep.heap[k];
      if (e.node <= 0 || static_cast<size_t>(e.node) >= nodes_.size()) fail("heap entry node");
      if (k > 0 && rep.heap[k] < rep.heap[(k - 1) / 2]) fail("heap order");
    }
  }
}

}  // namespace war::prefix
