// The router's war policy (war_policy.h): rules 1-3 and the bookkeeping, step by
// step as war/router/policies/war_policy_reference.py takes them.
#include "war_policy.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>

namespace war::policy {

namespace {

constexpr int32_t kNone = -1;

// Python's float-vs-int comparison, exact: -1, 0 or 1 (`d` not NaN).
int cmp_float_int(double d, __int128 i) {
  constexpr double kTop = 170141183460469231731687303715884105728.0;  // 2**127
  if (d >= kTop) return 1;
  if (d < -kTop) return -1;
  const double t = std::trunc(d);
  const auto ti = static_cast<__int128>(t);
  if (ti < i) return -1;
  if (ti > i) return 1;
  const double frac = d - t;
  return frac > 0 ? 1 : (frac < 0 ? -1 : 0);
}

// x compared with y as Python does; NaN: `unordered` (every comparison false).
enum class Order { kLess, kEqual, kGreater, kUnordered };

Order compare(const Num& x, const Num& y) {
  if (x.is_int && y.is_int) {
    return x.i < y.i ? Order::kLess : (x.i > y.i ? Order::kGreater : Order::kEqual);
  }
  if (!x.is_int && !y.is_int) {
    if (x.f < y.f) return Order::kLess;
    if (x.f > y.f) return Order::kGreater;
    return x.f == y.f ? Order::kEqual : Order::kUnordered;
  }
  const double d = x.is_int ? y.f : x.f;
  if (std::isnan(d)) return Order::kUnordered;
  int c = cmp_float_int(d, x.is_int ? x.i : y.i);
  if (x.is_int) c = -c;  // (d is y)
  return c < 0 ? Order::kLess : (c > 0 ? Order::kGreater : Order::kEqual);
}

Num num_of(double v) { return Num::of_float(v); }
Num num_of(int64_t v) { return Num::of_int(v); }

// Python's is_imbalanced(a, b, abs_threshold, rel_threshold):
// a - b > abs_threshold and a > rel_threshold * b.
bool imbalanced(const Num& a, const Num& b, const Num& abs_threshold, const Num& rel) {
  Num diff;
  if (a.is_int && b.is_int) {
    diff = Num::of_int(a.i - b.i);
  } else {
    diff = Num::of_float(a.f - b.f);
  }
  return gt(diff, abs_threshold) && gt(a, mul(rel, b));
}

// Python's tuple order, one field at a time: `a == b`: go on; else `a < b`.
template <class T>
inline int field_lt(const T& a, const T& b) {  // 1: less, 0: not less, -1: equal
  if (a == b) return -1;
  return a < b ? 1 : 0;
}

}  // namespace

bool gt(const Num& x, const Num& y) { return compare(x, y) == Order::kGreater; }

bool ge(const Num& x, const Num& y) {
  const Order o = compare(x, y);
  return o == Order::kGreater || o == Order::kEqual;
}

Num mul(const Num& a, const Num& b) {
  if (a.is_int && b.is_int) return Num::of_int(a.i * b.i);
  return Num::of_float(a.f * b.f);
}

// ---------------------------------------------------------------- routing

const Replica* Policy::select(const Request& q, std::vector<Replica>* healthy_in, double now,
                              Outside* out, bool* migrated) {
  std::vector<Replica>& healthy = *healthy_in;
  // healthy_sorted: by name, stably; loads a dict by name (the last one wins)
  std::stable_sort(healthy.begin(), healthy.end(),
                   [](const Replica& a, const Replica& b) { return a.name < b.name; });
  for (Replica& r : healthy) {
    __int128 used = 0;
    if (r.has_total && r.has_free) used = std::max<__int128>(0, static_cast<__int128>(r.total) - r.free);
    r.load = static_cast<double>(std::max<__int128>(r.tokens_in_flight, used));
  }
  for (size_t k = healthy.size(); k-- > 1;) {
    if (healthy[k - 1].name == healthy[k].name) healthy[k - 1].load = healthy[k].load;
  }

  const double ttl = cfg_.trajectory_ttl_s;
  if (!placements_.empty() && placements_.value(placements_.front()).at + ttl < now) {
    expire_placements(now);
  }
  int32_t state = kNone;
  if (q.tid != nullptr) {
    state = placements_.find(*q.tid);
    if (state != kNone && placements_.value(state).at + ttl < now) {  // (out of order times)
      placements_.erase(state);
      state = kNone;
    }
  }
  int64_t context_len = q.prompt_len;
  if (q.continues && state != kNone) context_len += placements_.value(state).context_len;
  if (!seen_.empty() && seen_[0].at < now - cfg_.finish_idle_s) expire_committed(now);

  // rule 1: the candidates
  // (in 128 bits: max_tokens may be up to 2**63 - 1, as SamplingParams allows, and the sum
  // must not wrap to a negative need that every replica fits)
  const __int128 need = static_cast<__int128>(context_len) + q.max_tokens;
  cands_.clear();
  bool all_fit = true;
  for (const Replica& r : healthy) {
    if (r.has_total && r.total < need) {
      all_fit = false;
      break;
    }
  }
  if (all_fit) {
    for (const Replica& r : healthy) cands_.push_back(&r);
  } else {
    for (const Replica& r : healthy) {
      if (!r.has_total || r.total >= need) cands_.push_back(&r);
    }
    if (cands_.empty()) {
      int64_t largest = 0;
      bool first = true;
      for (const Replica& r : healthy) {
        const int64_t t = r.total;  // (every one has a total here)
        if (first || t > largest) largest = t;
        first = false;
      }
      for (const Replica& r : healthy) {
        if (r.has_total && r.total == largest) cands_.push_back(&r);
      }
    }
  }
  double min_load = cands_[0]->load;
  for (const Replica* r : cands_) {
    if (r->load < min_load) min_load = r->load;
  }
  const int32_t holder = state != kNone ? placements_.value(state).replica : kNone;
  const Replica* held = nullptr;  // the holder among the candidates
  if (holder != kNone) {
    for (const Replica* r : cands_) {
      if (r->id == holder) {
        held = r;
        break;
      }
    }
  }

  // rule 2: stickiness
  *migrated = false;
  others_.clear();
  if (held != nullptr && !q.continues) {
    const Num own = mul(cfg_.migrate_own_weight, Num::of_int(need));
    if (imbalanced(num_of(held->load), num_of(min_load), py_max(cfg_.migrate_abs_tokens, own),
                   cfg_.migrate_rel)) {
      for (const Replica* r : cands_) {
        if (r->id != holder &&
            (!cfg_.migrate_needs_room || !r->has_free || r->free >= need)) {
          others_.push_back(r);
        }
      }
    }
  }
  const Replica* choice;
  if (held != nullptr && others_.empty()) {
    choice = held;
    ++stats_.sticky;
  } else if (state != kNone) {  // it had a replica: down, too small, or overloaded
    if (others_.empty()) {
      for (const Replica* r : cands_) {
        if (r->id != holder) others_.push_back(r);
      }
    }
    choice = place(q, others_.empty() ? cands_ : others_, out);
    *migrated = true;
    if (held != nullptr) {
      ++stats_.migrations;
    } else {
      ++stats_.failovers;
    }
  } else {
    choice = place(q, cands_, out);
  }
  if (!q.continues) out->insert(*choice);
  if (q.tid != nullptr) {
    put_placement(*q.tid, state, choice->id, context_len, now);
    const std::optional<double> remaining = out->begin();  // (as it stood)
    commit(*q.tid, choice->id,
           remaining ? py_max(*remaining, 1.0) : static_cast<double>(q.max_tokens), now,
           q.group);
  }
  return choice;
}

const Replica* Policy::place(const Request& q, const std::vector<const Replica*>& cands,
                             Outside* out) {
  const size_t n = cands.size();
  work_k_.resize(n);
  for (size_t k = 0; k < n; ++k) work_k_[k] = work_get(cands[k]->id);
  if (q.tid != nullptr) {  // a move: its work leaves its old replica
    const int32_t old = committed_.find(*q.tid);
    if (old != kNone) {
      const Commit& c = committed_.value(old);
      for (size_t k = 0; k < n; ++k) {
        if (cands[k]->id == c.replica) work_k_[k] -= c.work;
      }
    }
  }
  double min_work = work_k_[0];
  for (size_t k = 1; k < n; ++k) {
    if (work_k_[k] < min_work) min_work = work_k_[k];
  }
  const bool spread_group =
      cfg_.spread_unknown_groups && q.group != nullptr && !out->has_samples();
  count_k_.assign(n, 0);
  if (q.group != nullptr) {
    const std::string group(q.group->text);
    const auto it = counts_.find(group);
    if (it != counts_.end()) {
      for (size_t k = 0; k < n; ++k) {
        for (const auto& [r, c] : it->second) {
          if (r == cands[k]->id) count_k_[k] = c;
        }
      }
    }
  }
  lens_.assign(n, 0);
  const bool matched = q.continues ? false : out->match(cands, &lens_);
  hits_.clear();
  if (matched) {  // (nobody holding any of the prompt: no candidate can be a hit)
    const double mine = expected_work(q, out);
    const Num need = py_max(Num::of_float(1.0),
                            mul(cfg_.group_match_threshold, Num::of_int(q.prompt_len)));
    int64_t min_count = 0;
    if (q.group != nullptr) {
      min_count = count_k_[0];
      for (size_t k = 1; k < n; ++k) min_count = std::min(min_count, count_k_[k]);
    }
    double min_load = cands[0]->load;
    int64_t min_requests = cands[0]->num_requests;
    for (const Replica* r : cands) {
      if (r->load < min_load) min_load = r->load;
      min_requests = std::min(min_requests, r->num_requests);
    }
    const Num slack = Num::of_float(mul(cfg_.group_work_slack, Num::of_float(mine)).f);
    for (size_t k = 0; k < n; ++k) {
      const Replica& r = *cands[k];
      if (ge(Num::of_int(lens_[k]), need) && !(spread_group && count_k_[k] > min_count) &&
          !imbalanced(num_of(work_k_[k]), num_of(min_work), slack, cfg_.group_rel) &&
          !imbalanced(num_of(r.load), num_of(min_load), cfg_.group_abs_tokens, cfg_.group_rel) &&
          !imbalanced(Num::of_int(r.num_requests), Num::of_int(min_requests),
                      cfg_.group_abs_requests, cfg_.group_rel)) {
        hits_.push_back(k);
      }
    }
  }
  if (!hits_.empty()) {
    ++stats_.co_located;
    // min by (-matched, load + work, name)
    size_t best = hits_[0];
    for (size_t h = 1; h < hits_.size(); ++h) {
      const size_t k = hits_[h];
      int lt = field_lt(-lens_[k], -lens_[best]);
      if (lt < 0) {
        lt = field_lt(cands[k]->load + work_k_[k], cands[best]->load + work_k_[best]);
      }
      if (lt < 0) lt = cands[k]->name < cands[best]->name ? 1 : 0;
      if (lt == 1) best = k;
    }
    return cands[best];
  }
  ++stats_.spread;
  // min by (load + work, [group count,] -matched, requests, name)
  size_t best = 0;
  for (size_t k = 1; k < n; ++k) {
    int lt = field_lt(cands[k]->load + work_k_[k], cands[best]->load + work_k_[best]);
    if (lt < 0 && q.group != nullptr) lt = field_lt(count_k_[k], count_k_[best]);
    if (lt < 0) lt = field_lt(-lens_[k], -lens_[best]);
    if (lt < 0) lt = field_lt(cands[k]->num_requests, cands[best]->num_requests);
    if (lt < 0) lt = cands[k]->name < cands[best]->name ? 1 : 0;
    if (lt == 1) best = k;
  }
  return cands[best];
}

double Policy::expected_work(const Request& q, Outside* out) {
  std::optional<double> remaining;
  if (q.tid != nullptr) remaining = out->remaining_for();
  if (!remaining) remaining = out->expected_remaining_fleet();
  if (!remaining) return static_cast<double>(q.max_tokens);
  return py_max(*remaining, 1.0);
}

// ---------------------------------------------------------------- feedback

void Policy::complete(const Key& tid, int32_t replica, int64_t generated, int64_t max_tokens,
                      std::optional<double> remaining, double now) {
  int32_t state = placements_.find(tid);
  if (state != kNone && placements_.value(state).at + cfg_.trajectory_ttl_s < now) {
    placements_.erase(state);  // (expired: as if forgotten already)
    state = kNone;
  }
  if (state == kNone) return;
  const int64_t context_len = placements_.value(state).context_len + generated;
  put_placement(tid, state, replica, context_len, now);
  commit(tid, replica, remaining ? py_max(*remaining, 1.0) : static_cast<double>(max_tokens),
         now, nullptr);
}

void Policy::put_placement(const Key& tid, int32_t slot, int32_t replica, int64_t context_len,
                           double now) {
  if (slot == kNone) {
    placements_.push_back(tid, Placement{replica, context_len, now});
    while (placements_.size() > static_cast<size_t>(cfg_.max_trajectories)) {
      placements_.erase(placements_.front());
    }
  } else {
    Placement& p = placements_.value(slot);
    p.replica = replica;
    p.context_len = context_len;
    p.at = now;
    placements_.move_to_back(slot);
  }
}

void Policy::expire_placements(double now) {
  const double horizon = now - cfg_.trajectory_ttl_s;
  while (!placements_.empty()) {
    const int32_t s = placements_.front();
    if (placements_.value(s).at >= horizon) break;
    placements_.erase(s);
  }
}

void Policy::commit(const Key& tid, int32_t replica, double work, double now,
                    const Key* group) {
  bool has_group = group != nullptr;
  std::string g = has_group ? std::string(group->text) : std::string();
  bool same_group = false;
  const int32_t slot = committed_.find(tid);
  if (slot != kNone) {
    const Commit old = std::move(committed_.value(slot));
    committed_.erase(slot);
    if (!has_group) {
      has_group = old.has_group;
      g = old.group;
    }
    // the same group on the same replica: -1 then +1 would leave its count as is
    same_group = has_group && old.has_group && old.group == g && old.replica == replica;
    release(old, same_group);
  }
  committed_.push_back(tid, Commit{replica, work, now, has_group, has_group ? g : std::string()});
  if (work > 0) work_set(replica, work_get(replica) + work);
  if (has_group && !same_group) count_add(g, replica, 1);
  heap_push(Seen{now, std::string(tid.text)});
  if (seen_.size() > 4 * committed_.size() + 64) {  // drop stale heap entries
    seen_.clear();
    for (int32_t s = committed_.front(); s != kNone; s = committed_.next(s)) {
      seen_.push_back(Seen{committed_.value(s).at, committed_.key(s)});
    }
    for (size_t i = seen_.size() / 2; i-- > 0;) sift_up(i);  // heapify
  }
}

void Policy::uncommit(int32_t slot) {
  const Commit old = std::move(committed_.value(slot));
  committed_.erase(slot);
  release(old, false);
}

void Policy::release(const Commit& old, bool keep_count) {
  const double left = work_get(old.replica) - old.work;
  if (left <= 1e-9) {
    work_pop(old.replica);
  } else {
    work_set(old.replica, left);
  }
  if (old.has_group && !keep_count) count_add(old.group, old.replica, -1);
}

void Policy::expire_committed(double now) {
  const double horizon = now - cfg_.finish_idle_s;
  while (!seen_.empty() && seen_[0].at < horizon) {
    const Seen e = heap_pop();
    const int32_t slot = committed_.find(key_of(e.tid));
    if (slot != kNone && committed_.value(slot).at == e.at) uncommit(slot);
  }
}

void Policy::drop_commitments(int32_t replica) {
  std::vector<int32_t> drop;
  for (int32_t s = committed_.front(); s != kNone; s = committed_.next(s)) {
    if (committed_.value(s).replica == replica) drop.push_back(s);
  }
  for (const int32_t s : drop) uncommit(s);
}

void Policy::drop_placements(int32_t replica) {
  for (int32_t s = placements_.front(); s != kNone; s = placements_.next(s)) {
    Placement& p = placements_.value(s);
    if (p.replica == replica) p.replica = kNone;
  }
}

void Policy::forget(const Key& tid) {
  const int32_t p = placements_.find(tid);
  if (p != kNone) placements_.erase(p);
  const int32_t c = committed_.find(tid);
  if (c != kNone) uncommit(c);
}

std::vector<std::pair<int32_t, double>> Policy::committed_work() const {
  std::vector<std::pair<uint64_t, int32_t>> order;
  for (size_t r = 0; r < work_rank_.size(); ++r) {
    if (work_rank_[r] != 0) order.emplace_back(work_rank_[r], static_cast<int32_t>(r));
  }
  std::sort(order.begin(), order.end());
  std::vector<std::pair<int32_t, double>> out;
  out.reserve(order.size());
  for (const auto& [rank, r] : order) out.emplace_back(r, work_[static_cast<size_t>(r)]);
  return out;
}

// ---------------------------------------------------------------- tables

double Policy::work_get(int32_t r) const {
  const auto i = static_cast<size_t>(r);
  return i < work_rank_.size() && work_rank_[i] != 0 ? work_[i] : 0.0;
}

void Policy::work_set(int32_t r, double v) {
  const auto i = static_cast<size_t>(r);
  if (i >= work_rank_.size()) {
    work_rank_.resize(i + 1, 0);
    work_.resize(i + 1, 0.0);
  }
  if (work_rank_[i] == 0) work_rank_[i] = next_rank_++;  // (a new key goes last)
  work_[i] = v;
}

void Policy::work_pop(int32_t r) {
  const auto i = static_cast<size_t>(r);
  if (i < work_rank_.size()) work_rank_[i] = 0;
}

int64_t Policy::count_get(const std::string& group, int32_t r) const {
  const auto it = counts_.find(group);
  if (it == counts_.end()) return 0;
  for (const auto& [replica, c] : it->second) {
    if (replica == r) return c;
  }
  return 0;
}

void Policy::count_add(const std::string& group, int32_t r, int64_t delta) {
  auto& row = counts_[group];
  for (size_t k = 0; k < row.size(); ++k) {
    if (row[k].first == r) {
      row[k].second += delta;
      if (row[k].second <= 0) {
        row.erase(row.begin() + static_cast<std::ptrdiff_t>(k));
        if (row.empty()) counts_.erase(group);
      }
      return;
    }
  }
  if (delta > 0) {
    row.emplace_back(r, delta);
  } else if (row.empty()) {
    counts_.erase(group);
  }
}

// ---------------------------------------------------------------- heapq

bool Policy::seen_lt(const Seen& a, const Seen& b) {
  if (a.at == b.at) return a.tid < b.tid;
  return a.at < b.at;
}

void Policy::sift_down(size_t start, size_t pos) {  // heapq._siftdown
  Seen item = std::move(seen_[pos]);
  while (pos > start) {
    const size_t parent = (pos - 1) >> 1;
    if (seen_lt(item, seen_[parent])) {
      seen_[pos] = std::move(seen_[parent]);
      pos = parent;
      continue;
    }
    break;
  }
  seen_[pos] = std::move(item);
}

void Policy::sift_up(size_t pos) {  // heapq._siftup
  const size_t end = seen_.size();
  const size_t start = pos;
  Seen item = std::move(seen_[pos]);
  size_t child = 2 * pos + 1;
  while (child < end) {
    const size_t right = child + 1;
    if (right < end && !seen_lt(seen_[child], seen_[right])) child = right;
    seen_[pos] = std::move(seen_[child]);
    pos = child;
    child = 2 * pos + 1;
  }
  seen_[pos] = std::move(item);
  sift_down(start, pos);
}

void Policy::heap_push(Seen e) {
  seen_.push_back(std::move(e));
  sift_down(0, seen_.size() - 1);
}

Policy::Seen Policy::heap_pop() {
  Seen last = std::move(seen_.back());
  seen_.pop_back();
  if (seen_.empty()) return last;
  Seen top = std::move(seen_[0]);
  seen_[0] = std::move(last);
  sift_up(0);
  return top;
}

}  // namespace war::policy
