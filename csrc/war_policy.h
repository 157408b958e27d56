// The router's war policy: its rules and bookkeeping (rules 1-4 of
// war/router/policies/war_policy.py).
//
// Knows: where each recent trajectory's KV is (placements: an insertion-ordered
// map with a TTL and a capacity, values updated in place), the work committed to
// each replica (commitments, per-replica sums, per-group counts and the lazy heap
// of last-seen times that expires them), the load score, the candidates a request
// fits on, when a turn stays or moves, where a new trajectory goes, and the
// counts of the decisions. Does not know: Python, the prefix tree and the
// progress estimator (it asks them through `Outside`, in the reference's order),
// the clock (every time is the caller's `now`), nor replica names beyond their
// bytes (for ordering) and the caller's dense ids.
//
// The specification is war/router/policies/war_policy_reference.py: the same
// decisions, the same floating-point operations in the same order (sums of work
// updated as the reference updates them; the build has no fused multiply-add),
// the same orders of every table whose order is observable (placements and
// commitments are `OrderedMap`s, as the reference's OrderedDict and dict; the
// per-replica work keeps its keys' insertion order), the same heap (CPython's
// heapq algorithm) and Python's number semantics where the reference mixes ints
// and floats (`Num`: ints compared exactly, also against floats). Keys are byte
// strings (UTF-8), whose byte order is Python's str order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "progress.h"  // Key, OrderedMap

namespace war::policy {

using war::progress::Key;
using war::progress::key_of;
using war::progress::OrderedMap;

// A number as Python holds it: an int (exact; 128 bits hold any product or
// difference of two int64) or a float. `f` is the float of either (Python's
// float(int), correctly rounded).
struct Num {
  bool is_int = true;
  __int128 i = 0;
  double f = 0.0;

  static Num of_int(__int128 v) { return Num{true, v, static_cast<double>(v)}; }
  static Num of_float(double v) { return Num{false, 0, v}; }
};

// Python's `x > y` (and friends) for ints and floats, exactly.
bool gt(const Num& x, const Num& y);
bool ge(const Num& x, const Num& y);
// Python's max(a, b): b if b > a, else a.
inline const Num& py_max(const Num& a, const Num& b) { return gt(b, a) ? b : a; }
inline double py_max(double a, double b) { return b > a ? b : a; }
// Python's `a * b` for numbers.
Num mul(const Num& a, const Num& b);

// WarPolicyConfig, as the policy reads it.
struct Config {
  Num migrate_abs_tokens = Num::of_int(32768);
  Num migrate_rel = Num::of_float(1.5);
  Num migrate_own_weight = Num::of_float(1.0);
  bool migrate_needs_room = true;
  Num group_abs_tokens = Num::of_int(8192);
  Num group_rel = Num::of_float(1.1);
  Num group_abs_requests = Num::of_int(1);
  Num group_work_slack = Num::of_float(1.0);
  bool spread_unknown_groups = true;
  Num group_match_threshold = Num::of_float(0.5);
  double trajectory_ttl_s = 1800.0;
  int64_t max_trajectories = 100000;
  bool progress_priority = true;
  double finish_idle_s = 60.0;  // the progress estimator's
};

// A healthy replica as one request sees it.
struct Replica {
  std::string_view name;  // UTF-8 bytes (valid for the call)
  int32_t id = 0;         // the caller's dense id of the name
  int32_t input = 0;      // its position in the caller's list
  int64_t num_requests = 0;
  int64_t tokens_in_flight = 0;
  bool has_free = false;
  bool has_total = false;
  int64_t free = 0;
  int64_t total = 0;
  double load = 0.0;  // load_score; with names listed twice, the last one's (a dict)
};

// What the policy reads of a request.
struct Request {
  const Key* tid = nullptr;    // trajectory id; nullptr: None
  const Key* group = nullptr;  // group id; nullptr: None
  int64_t prompt_len = 0;
  int64_t max_tokens = 0;
  bool continues = false;
};

// The prefix tree and the progress estimator, as `select` asks them (each call
// the reference's call, at the reference's point; any may throw, and the policy
// is then as the reference's would be).
class Outside {
 public:
  virtual ~Outside() = default;
  virtual bool has_samples() = 0;  // progress.has_samples(group)
  // tree.match(prompt): whether it matched anything; (*lens)[k]: cands[k]'s length.
  virtual bool match(const std::vector<const Replica*>& cands, std::vector<int64_t>* lens) = 0;
  virtual std::optional<double> remaining_for() = 0;             // (tid, group)
  virtual std::optional<double> expected_remaining_fleet() = 0;  // (None, 0, 0)
  virtual void insert(const Replica& choice) = 0;  // tree.insert and the pending end
  virtual std::optional<double> begin() = 0;       // progress.begin(tid, group, now)
};

struct Stats {
  int64_t sticky = 0;
  int64_t migrations = 0;
  int64_t failovers = 0;
  int64_t co_located = 0;
  int64_t spread = 0;
};

class Policy {
 public:
  explicit Policy(const Config& config) : cfg_(config) {}

  // Rules 1-3 and the bookkeeping of a routed request (`healthy`: not empty; it
  // is sorted by name here and its loads set). Returns the chosen replica (an
  // element of `healthy`); *migrated as Decision.migrated.
  const Replica* select(const Request& q, std::vector<Replica>* healthy, double now,
                        Outside* out, bool* migrated);

  // A turn of trajectory `tid` completed on `replica` with `generated` tokens;
  // `remaining` is what progress.observe returned.
  void complete(const Key& tid, int32_t replica, int64_t generated, int64_t max_tokens,
                std::optional<double> remaining, double now);

  // on_replica_down: its commitments (before the tree forgets it) and then the
  // placements that pointed at it.
  void drop_commitments(int32_t replica);
  void drop_placements(int32_t replica);

  // finish_trajectory, after the estimator's finish.
  void forget(const Key& tid);

  size_t num_trajectories() const { return placements_.size(); }
  // (replica, work) in the reference's dict order.
  std::vector<std::pair<int32_t, double>> committed_work() const;
  const Stats& stats() const { return stats_; }
  const Config& config() const { return cfg_; }

 private:
  struct Placement {
    int32_t replica = -1;  // -1: that replica went down
    int64_t context_len = 0;
    double at = 0.0;
  };
  struct Commit {
    int32_t replica = -1;
    double work = 0.0;
    double at = 0.0;
    bool has_group = false;
    std::string group;
  };
  struct Seen {
    double at;
    std::string tid;
  };

  const Replica* place(const Request& q, const std::vector<const Replica*>& cands,
                       Outside* out);
  double expected_work(const Request& q, Outside* out);
  void put_placement(const Key& tid, int32_t slot, int32_t replica, int64_t context_len,
                     double now);
  void expire_placements(double now);
  void commit(const Key& tid, int32_t replica, double work, double now, const Key* group);
  void uncommit(int32_t slot);
  void release(const Commit& old, bool keep_count);
  void expire_committed(double now);

  // The per-replica work dict: value and insertion rank (0: absent).
  double work_get(int32_t r) const;
  void work_set(int32_t r, double v);
  void work_pop(int32_t r);
  int64_t count_get(const std::string& group, int32_t r) const;
  void count_add(const std::string& group, int32_t r, int64_t delta);

  // CPython's heapq on (time, trajectory id) tuples.
  static bool seen_lt(const Seen& a, const Seen& b);
  void sift_down(size_t start, size_t pos);
  void sift_up(size_t pos);
  void heap_push(Seen e);
  Seen heap_pop();

  Config cfg_;
  Stats stats_;
  OrderedMap<Placement> placements_;
  OrderedMap<Commit> committed_;
  std::vector<double> work_;
  std::vector<uint64_t> work_rank_;
  uint64_t next_rank_ = 1;
  std::unordered_map<std::string, std::vector<std::pair<int32_t, int64_t>>> counts_;
  std::vector<Seen> seen_;
  // scratch of `select` (reused: no allocation per request)
  std::vector<const Replica*> cands_, others_;
  std::vector<double> work_k_;
  std::vector<int64_t> lens_, count_k_;
  std::vector<size_t> hits_;
};

}  // namespace war::policy
