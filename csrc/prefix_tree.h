// Multi-replica prefix tree over token ids: the router's guess of which prompt
// prefixes each replica's KV cache holds.
//
// Knows: token sequences sent to (or completed on) each replica, when each
// replica last touched each prefix (times are given by the caller), a token
// budget per replica and which of a replica's leaves to evict first. Does not
// know: Python, replica names (replicas are small dense ints handed out by
// prefix_tree_bindings.cc), clocks, or what a replica really caches.
//
// The specification is war/router/policies/prefix_tree_reference.py: every
// operation here must give exactly the results of the reference, including
// which leaves an eviction removes when touch times tie. So this code follows
// the reference step by step where the order of steps is observable:
//
//  * a node's holders keep the order in which replicas came to hold it (a
//    Python dict's insertion order: `match` reports replicas in that order);
//  * the per-replica heaps of leaf candidates are binary heaps laid out exactly
//    as Python's heapq lays out a list (same sift steps), because compaction
//    keeps the *first* valid entry of a node in array order, and which entry
//    survives decides later tie-breaks between equal touch times;
//  * an eviction keeps popping the heap it started with even when a push
//    inside it compacts the replica's heap into a new one (the reference holds
//    on to the old list object; see `evict`).
//
// Nodes live in an arena and are addressed by index; a freed slot's generation
// is bumped, so a `Handle` (index + generation) to a removed node is detected
// instead of silently pointing at a recycled one. A split keeps the lower node
// (the one that ends where the old edge ended) in the old slot, so a handle to
// the end of an inserted path still ends that path, as in the reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace war::prefix {

using Token = int32_t;

// A broken invariant (check_integrity); the bindings raise AssertionError.
class IntegrityError : public std::logic_error {
 public:
  explicit IntegrityError(const std::string& what)
      : std::logic_error("prefix tree integrity: " + what) {}
};

// Token -> child node index. Nodes have few children except at branching
// points shared by many prompts (thousands), so small maps are scanned and a
// map that grows past kLinear entries gets an open-addressing index on top.
class ChildMap {
 public:
  struct Item {
    Token token;
    int32_t node;
  };

  int32_t find(Token t) const {
    if (index_.empty()) {
      for (const Item& it : items_)
        if (it.token == t) return it.node;
      return -1;
    }
    const size_t mask = index_.size() - 1;
    for (size_t i = home(t); ; i = (i + 1) & mask) {
      const int32_t p = index_[i];
      if (p < 0) return -1;
      if (items_[static_cast<size_t>(p)].token == t) return items_[static_cast<size_t>(p)].node;
    }
  }
  void put(Token t, int32_t node);  // inserts or replaces
  void erase(Token t);              // no-op when absent
  const std::vector<Item>& items() const { return items_; }
  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  void clear() {
    std::vector<Item>().swap(items_);
    std::vector<int32_t>().swap(index_);
  }
  void check() const;  // the index agrees with the items (throws IntegrityError)

 private:
  static constexpr size_t kLinear = 16;
  size_t home(Token t) const {
    // Fibonacci hashing: the top bits of the product spread nearby token ids.
    const uint64_t h = static_cast<uint64_t>(static_cast<uint32_t>(t)) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 32) & (index_.size() - 1);
  }
  size_t slot_of(Token t) const;  // index_ slot holding t (t present)
  void rebuild(size_t capacity);  // capacity 0 drops the index
  std::vector<Item> items_;       // unordered; erase moves the last item into the hole
  std::vector<int32_t> index_;    // positions in items_, -1 = empty; size a power of 2
};

struct Holder {
  int32_t replica;
  double time;  // last touch
};

struct Node {
  std::vector<Token> key;        // edge label (empty only for the root)
  ChildMap children;             // keyed by the first token of each child's key
  std::vector<Holder> holders;   // replicas holding the node, in the order they came
  int32_t parent = -1;
  uint64_t gen = 0;              // bumped when the slot is freed
  uint64_t mark = 0;             // scratch stamp (heap compaction)
  bool live = false;
};

// Where an inserted path ends (for `extend`).
struct Handle {
  int32_t node = -1;
  uint64_t gen = 0;
};

// A leaf candidate of a replica: the node, its touch time when pushed and the
// push order (ties of time break by it), as the reference's (time, seq, node).
struct HeapEntry {
  double time;
  uint64_t seq;
  int32_t node;
  uint64_t gen;
  bool operator<(const HeapEntry& o) const {
    return time < o.time || (time == o.time && seq < o.seq);
  }
};

class PrefixTree {
 public:
  // `budget`: tokens per replica (compared as a double, as the reference
  // compares whatever number it was given).
  explicit PrefixTree(double budget);

  double budget() const { return budget_; }

  // Makes replica ids 0..r valid.
  void ensure_replica(int32_t r);
  size_t num_replica_ids() const { return replicas_.size(); }

  // The longest prefix of toks[0, n) each replica holds, appended to `out` as
  // (replica, length) in the order the reference's dict would list them.
  void match(const Token* toks, size_t n, std::vector<std::pair<int32_t, int64_t>>* out);

  // Holds toks[0, n) (n > 0) for `r`, touched at `now`; evicts r's oldest
  // leaves while it is over budget; returns the end of the path. The handle's
  // generation is taken before the eviction, so an end evicted at once is
  // reported detached later.
  Handle insert(const Token* toks, size_t n, int32_t r, double now);

  // Whether `h` still names a node of the tree (the reference's "attached").
  bool attached(const Handle& h) const {
    return h.node > 0 && static_cast<size_t>(h.node) < nodes_.size() &&
           nodes_[static_cast<size_t>(h.node)].live && nodes_[static_cast<size_t>(h.node)].gen == h.gen;
  }

  // `end` attached: touches the path root..end for `r` and inserts toks below.
  Handle extend(const Handle& end, const Token* toks, size_t n, int32_t r, double now);

  // Evicts r's least recently used leaves until it holds at most `max_tokens`;
  // returns the tokens evicted.
  int64_t evict(int32_t r, double max_tokens);

  void remove_replica(int32_t r);

  int64_t num_tokens(int32_t r) const {
    return valid(r) ? replicas_[static_cast<size_t>(r)].tokens : 0;
  }
  int64_t num_nodes(int32_t r) const {
    return valid(r) ? replicas_[static_cast<size_t>(r)].nodes : 0;
  }
  // Whether the reference's count dicts have a key for `r` (touched since it
  // was last removed).
  bool known(int32_t r) const { return valid(r) && replicas_[static_cast<size_t>(r)].known; }
  const std::vector<HeapEntry>& heap(int32_t r) const;

  // Every node but the root as (path from the root, holders), depth first.
  void dump(std::vector<std::pair<std::vector<Token>, std::vector<Holder>>>* out) const;

  void check_integrity() const;  // throws IntegrityError

 private:
  struct Replica {
    int64_t tokens = 0;
    int64_t nodes = 0;
    bool known = false;
    std::vector<HeapEntry> heap;
  };

  bool valid(int32_t r) const { return r >= 0 && static_cast<size_t>(r) < replicas_.size(); }
  Node& at(int32_t i) { return nodes_[static_cast<size_t>(i)]; }
  const Node& at(int32_t i) const { return nodes_[static_cast<size_t>(i)]; }

  int32_t alloc();                 // a fresh live node (may move nodes_)
  void free_node(int32_t i);       // bumps the generation, releases memory
  void free_subtree(int32_t i);

  // Records that `r` holds node i, touched at `now`.
  void touch(int32_t i, int32_t r, double now);
  int32_t insert_from(int32_t start, const Token* toks, size_t n, int32_t r, double now,
                      uint64_t* end_gen);
  int32_t split(int32_t i, size_t k);  // returns the new upper node
  void drop(int32_t i, int32_t r);
  bool is_leaf_of(int32_t i, int32_t r) const;
  const Holder* holder(int32_t i, int32_t r) const;
  bool valid_entry(const HeapEntry& e, int32_t r) const;
  // Pushes node i as a leaf candidate of r; compacts r's heap when it grew too
  // big. Returns whether it compacted; the replaced heap is then moved into
  // *replaced (if given).
  bool push(int32_t r, int32_t i, std::vector<HeapEntry>* replaced);
  void compact(int32_t r, std::vector<HeapEntry>* replaced);

  double budget_;
  std::vector<Node> nodes_;  // nodes_[0] is the root
  std::vector<int32_t> free_;
  std::vector<Replica> replicas_;
  uint64_t seq_ = 0;        // push order, shared by all replicas as in the reference
  uint64_t next_gen_ = 1;   // generations are unique over the tree's life
  uint64_t mark_ = 0;
  std::vector<int64_t> match_slot_;  // per replica: position in match's output, -1 = none
};

}  // namespace war::prefix
