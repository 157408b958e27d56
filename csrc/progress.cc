// Trajectory progress (progress.h). Comments name the reference's functions
// (war/router/policies/progress_reference.py) that each part mirrors.
#include "progress.h"

#include <algorithm>
#include <limits>
#include <stdexcept>

namespace war::progress {

namespace {

constexpr double kHeavy = 0.25;       // the reference's _HEAVY
constexpr size_t kMaxCachedTurns = 64;  // entries of Samples::turns_left_ (a cache)
constexpr int32_t kNone = -1;

[[noreturn]] void broken(const char* what) {
  throw std::logic_error(std::string("progress estimator invariant: ") + what);
}

}  // namespace

// ---------------------------------------------------------------- TurnBuckets

TurnBuckets::Bucket* TurnBuckets::find(int64_t turns) {
  if (index_.empty()) return nullptr;
  for (size_t i = home(turns);; i = (i + 1) & mask_) {
    const int32_t p = index_[i];
    if (p < 0) return nullptr;
    Bucket& b = order_[static_cast<size_t>(p)];
    if (b.turns == turns) return &b;
  }
}

void TurnBuckets::add(int64_t turns, double w, double wk) {
  if (2 * (live_ + 1) > index_.size()) reindex(index_.empty() ? 16 : index_.size() * 2);
  const auto p = static_cast<int32_t>(order_.size());
  order_.push_back(Bucket{turns, 1.0, w, wk, true});
  size_t i = home(turns);
  while (index_[i] >= 0) i = (i + 1) & mask_;
  index_[i] = p;
  ++live_;
}

void TurnBuckets::erase(Bucket* b) {
  const auto p = static_cast<int32_t>(b - order_.data());
  size_t i = home(b->turns);
  while (index_[i] != p) i = (i + 1) & mask_;
  for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {  // backward-shift deletion
    const int32_t q = index_[j];
    if (q < 0) break;
    const size_t h = home(order_[static_cast<size_t>(q)].turns);
    const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
    if (!stays) {
      index_[i] = q;
      i = j;
    }
  }
  index_[i] = -1;
  b->live = false;
  --live_;
  if (order_.size() - live_ > live_ + 16) reindex(index_.size());
}

void TurnBuckets::clear() {
  order_.clear();
  std::fill(index_.begin(), index_.end(), -1);
  live_ = 0;
}

void TurnBuckets::reindex(size_t capacity) {
  size_t n = 0;
  for (const Bucket& b : order_)
    if (b.live) order_[n++] = b;  // (n never passes the read position)
  order_.resize(n);
  index_.assign(capacity, -1);
  mask_ = capacity - 1;
  for (size_t p = 0; p < n; ++p) {
    size_t i = home(order_[p].turns);
    while (index_[i] >= 0) i = (i + 1) & mask_;
    index_[i] = static_cast<int32_t>(p);
  }
}

// ---------------------------------------------------------------- Samples

// _Samples.put
void Samples::put(const Key& key, const Sample& sample) {
  const int32_t old = items_.find(key);
  if (old != kNone) {
    const Sample gone = items_.value(old);
    items_.erase(old);
    sub(gone);
  }
  items_.push_back(key, sample);
  if (!has_ref_ || (sample.end - ref_) / half_life_ > 256.0) {
    recompute();  // (which moves ``ref`` to the newest sample)
  } else {
    add(sample);
    changed();
  }
}

// _Samples.pop
bool Samples::pop(const Key& key) {
  const int32_t s = items_.find(key);
  if (s == kNone) return false;
  const Sample gone = items_.value(s);
  items_.erase(s);
  sub(gone);
  changed();
  return true;
}

// _Samples.pop_oldest
void Samples::pop_oldest() {
  const int32_t s = items_.front();
  const Sample gone = items_.value(s);
  items_.erase(s);
  sub(gone);
  changed();
}

// _Samples.remaining
double Samples::remaining(int64_t turns_done, int64_t tokens_done, double rate_prior_turns) {
  const double sample_rate = sum_wk_ > 0.0 ? sum_wt_ / sum_wk_ : 0.0;
  double remaining_turns = 0.0;
  bool cached = false;
  for (const auto& [k, v] : turns_left_) {
    if (k == turns_done) {
      remaining_turns = v;
      cached = true;
      break;
    }
  }
  if (!cached) {  // (a pass over the turn counts in the dict's order)
    const double k = static_cast<double>(turns_done);
    double ahead_w = 0.0;
    double ahead_wk = 0.0;
    for (const TurnBuckets::Bucket& b : by_turns_.order()) {
      if (b.live && b.turns > turns_done) {
        ahead_w += b.w;
        ahead_wk += b.wk - k * b.w;
      }
    }
    remaining_turns = ahead_w > 0.0 ? ahead_wk / ahead_w : 1.0;
    if (turns_left_.size() >= kMaxCachedTurns) turns_left_.clear();
    turns_left_.emplace_back(turns_done, remaining_turns);
  }
  const double c = rate_prior_turns;
  const double k_c = static_cast<double>(turns_done) + c;
  const double rate =
      k_c > 0 ? (static_cast<double>(tokens_done) + c * sample_rate) / k_c : sample_rate;
  return remaining_turns * rate;
}

// _Samples._add
void Samples::add(const Sample& s) {
  turns_left_.clear();
  const double w = weight(s);
  const double turns = static_cast<double>(s.turns);
  sum_w_ += w;
  sum_wt_ += w * static_cast<double>(s.tokens);
  sum_wk_ += w * turns;
  TurnBuckets::Bucket* b = by_turns_.find(s.turns);
  if (b == nullptr) {
    by_turns_.add(s.turns, w, w * turns);
  } else {
    b->count += 1.0;
    b->w += w;
    b->wk += w * turns;
  }
}

// _Samples._sub (`s` already out of items_)
void Samples::sub(const Sample& s) {
  turns_left_.clear();
  if (items_.empty()) {  // the last one left: nothing to subtract from
    recompute();
    return;
  }
  const double w = weight(s);
  const double turns = static_cast<double>(s.turns);
  TurnBuckets::Bucket* b = by_turns_.find(s.turns);
  if (b == nullptr) broken("a held sample's turn count has no bucket");
  if ((b->count > 1.0 && w > kHeavy * b->w) || w > kHeavy * sum_w_) {
    recompute();
    return;
  }
  sum_w_ -= w;
  sum_wt_ -= w * static_cast<double>(s.tokens);
  sum_wk_ -= w * turns;
  if (b->count <= 1.0) {
    by_turns_.erase(b);  // exactly zero, not a rounding residue
  } else {
    b->count -= 1.0;
    b->w -= w;
    b->wk -= w * turns;
  }
}

// _Samples._changed
void Samples::changed() {
  ++changes_;
  if (changes_ > std::max<int64_t>(64, static_cast<int64_t>(items_.size()))) recompute();
}

// _Samples._recompute
void Samples::recompute() {
  changes_ = 0;
  sum_w_ = sum_wt_ = sum_wk_ = 0.0;
  by_turns_.clear();
  turns_left_.clear();
  if (items_.empty()) {
    has_ref_ = false;
    ref_ = 0.0;
    return;
  }
  // Python's max(): the first, replaced by each later one that compares greater.
  int32_t s = items_.front();
  double newest = items_.value(s).end;
  for (s = items_.next(s); s != kNone; s = items_.next(s)) {
    const double end = items_.value(s).end;
    if (end > newest) newest = end;
  }
  ref_ = newest;
  has_ref_ = true;
  for (s = items_.front(); s != kNone; s = items_.next(s)) add(items_.value(s));
}

// ---------------------------------------------------------------- Estimator

Estimator::Estimator(const Config& config) : cfg_(config), global_(config.half_life_s) {
  // (ProgressConfig validates the same, with its own messages)
  if (!(cfg_.finish_idle_s > 0) || !(cfg_.trajectory_ttl_s >= cfg_.finish_idle_s) ||
      !(cfg_.half_life_s > 0) || cfg_.max_trajectories < 1 || cfg_.max_samples_per_group < 1 ||
      cfg_.max_groups < 1 || cfg_.max_global_samples < 1 || !(cfg_.rate_prior_turns >= 0))
    throw std::invalid_argument("invalid progress estimator config");
}

int32_t Estimator::find(const Key& tid) const { return trajs_.find(tid); }

void Estimator::unlink(int32_t s) {
  Traj& t = traj(s);
  List& l = lists_[t.table];
  if (t.prev != kNone) traj(t.prev).next = t.next; else l.head = t.next;
  if (t.next != kNone) traj(t.next).prev = t.prev; else l.tail = t.prev;
  --l.size;
  t.prev = t.next = kNone;
  t.table = kTaken;
}

void Estimator::put(int32_t s, uint8_t table) {
  Traj& t = traj(s);
  List& l = lists_[table];
  t.table = table;
  t.prev = l.tail;
  t.next = kNone;
  if (l.tail != kNone) traj(l.tail).next = s; else l.head = s;
  l.tail = s;
  ++l.size;
}

// _take
int32_t Estimator::take(const Key& tid) {
  const int32_t s = find(tid);
  if (s != kNone) unlink(s);
  return s;
}

void Estimator::drop(int32_t s) {
  if (traj(s).table != kTaken) unlink(s);
  trajs_.erase(s);
}

int32_t Estimator::create(const Key& tid, const Key* group) {
  Traj t;
  if (group != nullptr) set_group(t, *group);
  t.table = kTaken;
  return trajs_.push_back(tid, std::move(t));
}

void Estimator::set_group(Traj& t, const Key& group) {
  t.group.assign(group.text.data(), group.text.size());
  t.group_hash = group.hash;
  t.has_group = true;
}

// begin
std::optional<double> Estimator::begin(const Key& tid, const Key* group, double now) {
  std::optional<double> estimate_before;
  const int32_t found = find(tid);
  if (found == kNone) {
    estimate_before = estimate(group, 0, 0);
  } else {
    const Traj& t = traj(found);
    if (t.in_flight == std::numeric_limits<int64_t>::max())
      throw std::overflow_error("requests in flight overflow int64");
    const Key own{t.group, t.group_hash};
    estimate_before = estimate(group != nullptr ? group : (t.has_group ? &own : nullptr),
                               t.turns, t.tokens);
  }
  expire(now);
  int32_t s = take(tid);
  if (s == kNone) {
    s = create(tid, group);
  } else if (traj(s).counted) {  // it was not finished after all
    uncount(s);
  }
  Traj& t = traj(s);
  if (group != nullptr) set_group(t, *group);
  t.in_flight += 1;
  t.since = now;
  put(s, kActive);
  bound();
  return estimate_before;
}

// observe
std::optional<double> Estimator::observe(const Key& tid, const Key* group,
                                         int64_t generated_tokens, double now) {
  if (generated_tokens < 0) throw std::invalid_argument("generated_tokens < 0");
  const int32_t found = find(tid);
  if (found != kNone) {
    const Traj& t = traj(found);
    if (t.turns == std::numeric_limits<int64_t>::max() ||
        t.tokens > std::numeric_limits<int64_t>::max() - generated_tokens)
      throw std::overflow_error("a trajectory's turns or tokens overflow int64");
  }
  expire(now);
  int32_t s = take(tid);
  if (s == kNone) {  // forgotten (or never begun here): start from this turn
    s = create(tid, group);
  } else if (traj(s).counted) {
    uncount(s);
  }
  {
    Traj& t = traj(s);
    if (group != nullptr) set_group(t, *group);
    t.turns += 1;
    t.tokens += generated_tokens;
  }
  settle(s, now);
  // (``settle`` may have dropped it to stay within bounds: then nothing is known)
  const int32_t still = find(tid);
  if (still == kNone) return remaining_for(tid, group);
  const Traj& t = traj(still);
  const Key own{t.group, t.group_hash};
  return estimate(t.has_group ? &own : nullptr, t.turns, t.tokens);
}

// abort
void Estimator::abort(const Key& tid, double now) {
  expire(now);
  const int32_t s = take(tid);
  if (s != kNone) settle(s, now);
}

// finish
void Estimator::finish(const Key& tid, double now) {
  expire(now);
  const int32_t s = take(tid);
  if (s == kNone) return;
  traj(s).in_flight = 0;
  if (!traj(s).counted) {
    traj(s).since = now;
    count(s);
  }
  put(s, kDone);
}

// add_sample
void Estimator::add_sample(const Key* group, int64_t turns, int64_t tokens, double now,
                           const Key* tid) {
  if (turns < 1 || tokens < 0)
    throw std::invalid_argument("a sample needs turns >= 1 and tokens >= 0");
  const Sample sample{turns, tokens, now};
  if (tid != nullptr) {
    record(*tid, group, sample);
    return;
  }
  std::string key("\0sample", 7);
  key += std::to_string(anon_++);
  record(key_of(key), group, sample);
}

// progress / _find
const Traj* Estimator::progress(const Key& tid) const {
  const int32_t s = find(tid);
  return s == kNone ? nullptr : &trajs_.value(s);
}

const Samples* Estimator::samples(const Key* group) const {
  if (group == nullptr) return &global_;
  const int32_t g = groups_.find(*group);
  return g == kNone ? nullptr : &groups_.value(g);
}

bool Estimator::has_samples(const Key* group) const {
  const Samples* table = samples(group);
  return table != nullptr && !table->empty();
}

// expected_remaining
std::optional<double> Estimator::expected_remaining(const Key* group, int64_t turns_done,
                                                    int64_t tokens_done) {
  return estimate(group, turns_done, tokens_done);
}

std::optional<double> Estimator::estimate(const Key* group, int64_t turns_done,
                                          int64_t tokens_done) {
  Samples* table = nullptr;
  if (group != nullptr) {
    const int32_t g = groups_.find(*group);
    if (g != kNone) table = &groups_.value(g);
  }
  if (table == nullptr || table->empty()) {
    table = &global_;
    if (table->empty()) return std::nullopt;
  }
  return table->remaining(turns_done, tokens_done, cfg_.rate_prior_turns);
}

// remaining_for
std::optional<double> Estimator::remaining_for(const Key& tid, const Key* group) {
  const int32_t s = find(tid);
  if (s == kNone) return estimate(group, 0, 0);
  const Traj& t = traj(s);
  const Key own{t.group, t.group_hash};
  return estimate(group != nullptr ? group : (t.has_group ? &own : nullptr), t.turns, t.tokens);
}

// expire
void Estimator::expire(double now) {
  List& idle = lists_[kIdle];
  while (idle.head != kNone) {  // (the oldest first)
    const int32_t s = idle.head;
    if (traj(s).since + cfg_.finish_idle_s > now) break;
    unlink(s);
    count(s);
    put(s, kDone);
  }
  const double ttl = cfg_.trajectory_ttl_s;
  for (const uint8_t table : {kDone, kActive}) {
    const List& l = lists_[table];
    while (l.head != kNone) {
      if (traj(l.head).since + ttl >= now) break;
      drop(l.head);
    }
  }
}

// _bound
void Estimator::bound() {
  const auto cap = static_cast<size_t>(cfg_.max_trajectories);
  if (num_tracked() <= cap) return;
  while (num_tracked() > cap && lists_[kDone].head != kNone) drop(lists_[kDone].head);
  while (num_tracked() > cap && lists_[kIdle].head != kNone) {
    const int32_t s = lists_[kIdle].head;
    unlink(s);
    count(s);  // idle the longest: most likely finished
    trajs_.erase(s);
  }
  while (num_tracked() > cap && lists_[kActive].head != kNone) drop(lists_[kActive].head);
}

// _settle
void Estimator::settle(int32_t s, double now) {
  Traj& t = traj(s);
  t.in_flight = std::max<int64_t>(0, t.in_flight - 1);
  t.since = now;
  put(s, t.in_flight != 0 ? kActive : kIdle);
  bound();
}

// _count
void Estimator::count(int32_t s) {
  Traj& t = traj(s);
  t.counted = true;
  if (t.turns >= 1) {
    const Key own{t.group, t.group_hash};
    record(trajs_.key_at(s), t.has_group ? &own : nullptr, Sample{t.turns, t.tokens, t.since});
  }
}

// _uncount
void Estimator::uncount(int32_t s) {
  Traj& t = traj(s);
  t.counted = false;
  const Key tid = trajs_.key_at(s);
  if (t.has_group) {
    const int32_t g = groups_.find(Key{t.group, t.group_hash});
    if (g != kNone) groups_.value(g).pop(tid);
  }
  global_.pop(tid);
}

// _record
void Estimator::record(const Key& key, const Key* group, const Sample& sample) {
  if (group != nullptr) {
    int32_t g = groups_.find(*group);
    if (g == kNone) g = groups_.push_back(*group, Samples(cfg_.half_life_s));
    Samples& samples = groups_.value(g);
    samples.put(key, sample);
    while (samples.size() > static_cast<size_t>(cfg_.max_samples_per_group)) samples.pop_oldest();
    groups_.move_to_back(g);  // most recently updated last
    while (groups_.size() > static_cast<size_t>(cfg_.max_groups)) groups_.erase(groups_.front());
  }
  global_.put(key, sample);
  while (global_.size() > static_cast<size_t>(cfg_.max_global_samples)) global_.pop_oldest();
}

}  // namespace war::progress
