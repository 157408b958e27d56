// Trajectory progress and groups' finished samples: the router's estimate of
// how much work a trajectory probably has left.
//
// Knows: each tracked trajectory's progress (turns, generated tokens, requests
// in flight, when it was last seen), which trajectories count as finished, and
// per group (and fleet-wide) the finished samples with the weighted sums of the
// estimate. Does not know: Python, the clock (every time is the caller's
// `now`), token contents, replicas, or what the estimate is used for. Keys
// (trajectory and group ids) are byte strings; a group is optional (`nullptr`).
//
// The specification is war/router/policies/progress_reference.py: every
// operation here must give exactly the reference's results, bit for bit,
// because a simulator replays the routing policy that reads them. So this code
// follows the reference step by step wherever the order of steps is observable:
//
//  * the same floating-point operations in the same order (weights are
//    std::pow(2.0, (end - ref) / half_life), as Python's `2.0 ** x`; sums are
//    updated as the reference updates them; the build has no fused multiply-add);
//  * every OrderedDict of the reference is an `OrderedMap` (insertion ordered,
//    a key taken out and put back goes last, the oldest pops first), and the
//    reference's plain dict of turn counts, whose order decides the order of a
//    floating-point sum, is a `TurnBuckets` with the same (insertion) order;
//  * a trajectory is in exactly one of the reference's three tables (active,
//    idle, done), so one index serves the three, each an ordered list.
//
// Integers (turns, tokens) are int64 (the reference's are unbounded; a total
// that would pass 2**63 - 1 throws std::overflow_error, state unchanged); times
// are doubles.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace war::progress {

// A key and its hash (computed once per call, used by every table it meets).
struct Key {
  std::string_view text;
  uint64_t hash;
};

inline Key key_of(std::string_view text) {
  return Key{text, static_cast<uint64_t>(std::hash<std::string_view>{}(text))};
}

// ---------------------------------------------------------------- OrderedMap

// String key -> V in insertion order, as a Python OrderedDict used the way the
// reference uses it: look up, append a key that is absent, erase, take the
// oldest. Entries live in slots (reused after erase); an open-addressing index
// (linear probing, no tombstones) maps keys to slots; a doubly linked list
// through the slots keeps the order.
template <class V>
class OrderedMap {
 public:
  static constexpr int32_t kNone = -1;

  int32_t find(const Key& k) const {
    if (index_.empty()) return kNone;
    for (size_t i = k.hash & mask_;; i = (i + 1) & mask_) {
      const int32_t s = index_[i];
      if (s == kNone) return kNone;
      const Slot& e = slots_[static_cast<size_t>(s)];
      if (e.hash == k.hash && e.key == k.text) return s;
    }
  }

  // Appends `k` (absent) as the newest; returns its slot.
  int32_t push_back(const Key& k, V value) {
    if (2 * (size_ + 1) > index_.size()) grow();
    int32_t s;
    if (!free_.empty()) {
      s = free_.back();
      free_.pop_back();
    } else {
      s = static_cast<int32_t>(slots_.size());
      slots_.emplace_back();
    }
    Slot& e = slots_[static_cast<size_t>(s)];
    e.key.assign(k.text.data(), k.text.size());
    e.hash = k.hash;
    e.value = std::move(value);
    size_t i = k.hash & mask_;
    while (index_[i] != kNone) i = (i + 1) & mask_;
    index_[i] = s;
    e.prev = tail_;
    e.next = kNone;
    if (tail_ != kNone) slots_[static_cast<size_t>(tail_)].next = s; else head_ = s;
    tail_ = s;
    ++size_;
    return s;
  }

  // Removes slot `s` (live); its value is reset to `V()`.
  void erase(int32_t s) {
    Slot& e = slot(s);
    unlink(s);
    size_t i = e.hash & mask_;
    while (index_[i] != s) i = (i + 1) & mask_;
    // Backward-shift deletion: move later members of the probe run into the hole.
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      const int32_t t = index_[j];
      if (t == kNone) break;
      const size_t h = slots_[static_cast<size_t>(t)].hash & mask_;
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        index_[i] = t;
        i = j;
      }
    }
    index_[i] = kNone;
    e.value = V();
    free_.push_back(s);
    --size_;
  }

  // Moves slot `s` to the newest place (a pop and reinsert of the reference).
  void move_to_back(int32_t s) {
    if (s == tail_) return;
    unlink(s);
    Slot& e = slot(s);
    e.prev = tail_;
    e.next = kNone;
    slots_[static_cast<size_t>(tail_)].next = s;
    tail_ = s;
  }

  void clear() {
    slots_.clear();
    free_.clear();
    index_.clear();
    mask_ = 0;
    head_ = tail_ = kNone;
    size_ = 0;
  }

  int32_t front() const { return head_; }
  int32_t next(int32_t s) const { return slots_[static_cast<size_t>(s)].next; }
  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  V& value(int32_t s) { return slot(s).value; }
  const V& value(int32_t s) const { return slots_[static_cast<size_t>(s)].value; }
  const std::string& key(int32_t s) const { return slots_[static_cast<size_t>(s)].key; }
  Key key_at(int32_t s) const {
    const Slot& e = slots_[static_cast<size_t>(s)];
    return Key{e.key, e.hash};
  }

 private:
  struct Slot {
    std::string key;
    uint64_t hash = 0;
    V value{};
    int32_t prev = kNone;
    int32_t next = kNone;
  };

  Slot& slot(int32_t s) { return slots_[static_cast<size_t>(s)]; }

  void unlink(int32_t s) {
    Slot& e = slot(s);
    if (e.prev != kNone) slot(e.prev).next = e.next; else head_ = e.next;
    if (e.next != kNone) slot(e.next).prev = e.prev; else tail_ = e.prev;
  }

  void grow() {
    const size_t capacity = index_.empty() ? 16 : index_.size() * 2;
    index_.assign(capacity, kNone);
    mask_ = capacity - 1;
    for (int32_t s = head_; s != kNone; s = slots_[static_cast<size_t>(s)].next) {
      size_t i = slots_[static_cast<size_t>(s)].hash & mask_;
      while (index_[i] != kNone) i = (i + 1) & mask_;
      index_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  std::vector<int32_t> free_;
  std::vector<int32_t> index_;  // slots; size a power of 2, at most half full
  size_t mask_ = 0;
  int32_t head_ = kNone;  // the oldest
  int32_t tail_ = kNone;  // the newest
  size_t size_ = 0;
};

// ---------------------------------------------------------------- samples

struct Sample {
  int64_t turns = 0;
  int64_t tokens = 0;
  double end = 0.0;
};

// The reference's `by_turns`: turns -> [count, sum w, sum w * turns], in the
// insertion order of a Python dict (a deleted key put back goes last). Erased
// entries stay as holes in the order until holes outnumber the rest.
class TurnBuckets {
 public:
  struct Bucket {
    int64_t turns;
    double count;
    double w;
    double wk;
    bool live;
  };

  Bucket* find(int64_t turns);
  void add(int64_t turns, double w, double wk);  // `turns` absent: appended with count 1
  void erase(Bucket* b);
  void clear();
  const std::vector<Bucket>& order() const { return order_; }  // holes have !live
  size_t size() const { return live_; }

 private:
  size_t home(int64_t turns) const {
    return static_cast<size_t>((static_cast<uint64_t>(turns) * 0x9E3779B97F4A7C15ull) >> 32) &
           mask_;
  }
  void reindex(size_t capacity);  // also drops the holes

  std::vector<Bucket> order_;
  std::vector<int32_t> index_;  // positions in order_, -1 empty (linear probing)
  size_t mask_ = 0;
  size_t live_ = 0;
};

// The reference's `_Samples`: finished samples, oldest first, with the sums
// of the estimate kept as samples come and go (see progress_reference.py).
class Samples {
 public:
  explicit Samples(double half_life = 1.0) : half_life_(half_life) {}

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  const OrderedMap<Sample>& items() const { return items_; }

  void put(const Key& key, const Sample& sample);
  bool pop(const Key& key);  // whether it held one
  void pop_oldest();         // (not empty)
  double remaining(int64_t turns_done, int64_t tokens_done, double rate_prior_turns);

 private:
  double weight(const Sample& s) const { return std::pow(2.0, (s.end - ref_) / half_life_); }
  void add(const Sample& s);
  void sub(const Sample& s);
  void changed();
  void recompute();

  OrderedMap<Sample> items_;
  double half_life_;
  bool has_ref_ = false;
  double ref_ = 0.0;
  int64_t changes_ = 0;
  double sum_w_ = 0.0;
  double sum_wt_ = 0.0;
  double sum_wk_ = 0.0;
  TurnBuckets by_turns_;
  // turns done -> remaining turns, until a change (a cache: only speed depends on
  // its size, so it is emptied when full)
  std::vector<std::pair<int64_t, double>> turns_left_;
};

// ---------------------------------------------------------------- estimator

struct Config {
  double finish_idle_s = 60.0;
  double trajectory_ttl_s = 1800.0;
  int64_t max_trajectories = 100000;
  double half_life_s = 1800.0;
  int64_t max_samples_per_group = 64;
  int64_t max_groups = 10000;
  int64_t max_global_samples = 1024;
  double rate_prior_turns = 2.0;
};

struct Traj {
  std::string group;  // (has_group)
  uint64_t group_hash = 0;
  bool has_group = false;
  int64_t turns = 0;
  int64_t tokens = 0;
  int64_t in_flight = 0;
  double since = 0.0;
  bool counted = false;
  uint8_t table = 0;  // kActive, kIdle, kDone, or kTaken between a take and a put
  int32_t prev = -1;  // neighbours in its table's list (slots of Estimator::trajs_)
  int32_t next = -1;
};

class Estimator {
 public:
  static constexpr uint8_t kActive = 0, kIdle = 1, kDone = 2, kTaken = 3;

  explicit Estimator(const Config& config);  // throws std::invalid_argument
  const Config& config() const { return cfg_; }

  // The reference's methods of the same names; `group` may be nullptr (None).
  std::optional<double> begin(const Key& tid, const Key* group, double now);
  // `generated_tokens` >= 0 (else std::invalid_argument, state unchanged).
  std::optional<double> observe(const Key& tid, const Key* group, int64_t generated_tokens,
                                double now);
  void abort(const Key& tid, double now);
  void finish(const Key& tid, double now);
  // turns >= 1, tokens >= 0 (else std::invalid_argument); `tid` nullptr: an
  // anonymous key "\0sample<n>".
  void add_sample(const Key* group, int64_t turns, int64_t tokens, double now, const Key* tid);

  const Traj* progress(const Key& tid) const;
  // The group's samples (nullptr group: the fleet's); nullptr when unknown.
  const Samples* samples(const Key* group) const;
  bool has_samples(const Key* group) const;
  std::optional<double> expected_remaining(const Key* group, int64_t turns_done,
                                           int64_t tokens_done);
  std::optional<double> remaining_for(const Key& tid, const Key* group);
  size_t num_tracked() const {
    return lists_[kActive].size + lists_[kIdle].size + lists_[kDone].size;
  }
  void expire(double now);

  // Group ids, least recently updated first (for tests).
  const OrderedMap<Samples>& groups() const { return groups_; }

 private:
  struct List {
    int32_t head = -1;
    int32_t tail = -1;
    size_t size = 0;
  };

  int32_t find(const Key& tid) const;  // a tracked trajectory's slot, or -1
  int32_t take(const Key& tid);        // unlinked from its table (kTaken), or -1
  void put(int32_t s, uint8_t table);  // appended to `table`
  void unlink(int32_t s);
  void drop(int32_t s);                // forgotten
  int32_t create(const Key& tid, const Key* group);  // a new, taken trajectory
  void set_group(Traj& t, const Key& group);
  void bound();
  void settle(int32_t s, double now);
  void count(int32_t s);
  void uncount(int32_t s);
  void record(const Key& key, const Key* group, const Sample& sample);
  std::optional<double> estimate(const Key* group, int64_t turns_done, int64_t tokens_done);
  Traj& traj(int32_t s) { return trajs_.value(s); }

  Config cfg_;
  // Trajectories: one index (the map's own order is unused) and, through the
  // links in Traj, one ordered list per table (the reference's three OrderedDicts).
  OrderedMap<Traj> trajs_;
  List lists_[3];
  OrderedMap<Samples> groups_;
  Samples global_;
  uint64_t anon_ = 0;  // the reference's itertools.count() of anonymous samples
};

}  // namespace war::progress
