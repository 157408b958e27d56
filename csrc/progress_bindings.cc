// Python bindings of the router's progress estimator (module
// war.router.policies._progress). The only Python module that imports it is
// war/router/policies/progress.py, which subclasses the class bound here.
//
// Knows: how Python callers pass things (ids as str, group ids as str or None,
// counts as ints, times as numbers) and how to turn them into the estimator's
// byte-string keys, int64s and doubles and back; the ProgressConfig attribute
// names; the result types (Sample and Progress are given to the constructor).
// Every argument is converted and checked before the estimator is touched, so a
// bad call raises (TypeError / ValueError / OverflowError) and leaves it as it
// was. Does not know the estimator's algorithm (progress.h).
//
// Ids are read as UTF-8 (a str with lone surrogates as 'surrogatepass' bytes, so
// that any two different str are different keys). Calls are short (well under a
// microsecond), so the GIL is kept.
#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "progress.h"
#include "py_args.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace wg = war::progress;

namespace {

using war::pyargs::float_of;
using war::pyargs::int_of;
using war::pyargs::OptText;
using war::pyargs::raise_type;
using war::pyargs::str_of;
using war::pyargs::Text;

nb::object float_or_none(const std::optional<double>& v) {
  if (!v) return nb::none();
  return nb::steal(PyFloat_FromDouble(*v));
}

wg::Config config_of(nb::handle config) {
  auto number = [&](const char* name) {
    nb::object v = nb::getattr(config, name);
    return float_of(v.ptr(), name);
  };
  auto integer = [&](const char* name) {
    nb::object v = nb::getattr(config, name);
    return int_of(v.ptr(), name);
  };
  wg::Config c;
  c.finish_idle_s = number("finish_idle_s");
  c.trajectory_ttl_s = number("trajectory_ttl_s");
  c.max_trajectories = integer("max_trajectories");
  c.half_life_s = number("half_life_s");
  c.max_samples_per_group = integer("max_samples_per_group");
  c.max_groups = integer("max_groups");
  c.max_global_samples = integer("max_global_samples");
  c.rate_prior_turns = number("rate_prior_turns");
  return c;
}

class Estimator {
 public:
  Estimator(nb::handle config, nb::handle sample_type, nb::handle progress_type)
      : est_(config_of(config)),
        config_(nb::borrow(config)),
        sample_type_(nb::borrow(sample_type)),
        progress_type_(nb::borrow(progress_type)) {}

  nb::object config() const { return config_; }

  nb::object begin(nb::handle tid, nb::handle group, nb::handle now) {
    const Text t(tid.ptr(), "trajectory_id");
    const OptText g(group.ptr(), "group_id");
    const double when = float_of(now.ptr(), "now");
    return float_or_none(est_.begin(t.key, g.get(), when));
  }

  nb::object observe(nb::handle tid, nb::handle group, nb::handle generated, nb::handle now) {
    const Text t(tid.ptr(), "trajectory_id");
    const OptText g(group.ptr(), "group_id");
    const int64_t n = int_of(generated.ptr(), "generated_tokens");
    const double when = float_of(now.ptr(), "now");
    if (n < 0) {
      PyErr_Format(PyExc_ValueError, "trajectory %S: generated_tokens < 0", tid.ptr());
      throw nb::python_error();
    }
    return float_or_none(est_.observe(t.key, g.get(), n, when));
  }

  void abort(nb::handle tid, nb::handle now) {
    const Text t(tid.ptr(), "trajectory_id");
    est_.abort(t.key, float_of(now.ptr(), "now"));
  }

  void finish(nb::handle tid, nb::handle now) {
    const Text t(tid.ptr(), "trajectory_id");
    est_.finish(t.key, float_of(now.ptr(), "now"));
  }

  void add_sample(nb::handle group, nb::handle turns, nb::handle tokens, nb::handle now,
                  nb::handle tid) {
    const int64_t k = int_of(turns.ptr(), "turns");
    const int64_t n = int_of(tokens.ptr(), "tokens");
    if (k < 1 || n < 0) {
      PyErr_Format(PyExc_ValueError, "a sample needs turns >= 1 and tokens >= 0, got %S, %S",
                   turns.ptr(), tokens.ptr());
      throw nb::python_error();
    }
    const OptText g(group.ptr(), "group_id");
    const double when = float_of(now.ptr(), "now");
    const OptText t(tid.ptr(), "trajectory_id");
    est_.add_sample(g.get(), k, n, when, t.get());
  }

  nb::object progress(nb::handle tid) {
    const Text t(tid.ptr(), "trajectory_id");
    const wg::Traj* p = est_.progress(t.key);
    if (p == nullptr) return nb::none();
    // (copied out before Python code runs)
    nb::object group = p->has_group ? str_of(p->group) : nb::none();
    const int64_t turns = p->turns, tokens = p->tokens, in_flight = p->in_flight;
    return progress_type_(group, turns, tokens, in_flight);
  }

  nb::list samples(nb::handle group) {
    const OptText g(group.ptr(), "group_id");
    std::vector<wg::Sample> held;
    if (const wg::Samples* table = est_.samples(g.get())) {
      held.reserve(table->size());
      const auto& items = table->items();
      for (int32_t s = items.front(); s >= 0; s = items.next(s)) held.push_back(items.value(s));
    }
    nb::list out;
    for (const wg::Sample& x : held) out.append(sample_type_(x.turns, x.tokens, x.end));
    return out;
  }

  bool has_samples(nb::handle group) {
    const OptText g(group.ptr(), "group_id");
    return est_.has_samples(g.get());
  }

  nb::object expected_remaining(nb::handle group, nb::handle turns_done,
                                nb::handle tokens_done) {
    const OptText g(group.ptr(), "group_id");
    const int64_t k = int_of(turns_done.ptr(), "turns_done");
    const int64_t d = int_of(tokens_done.ptr(), "tokens_done");
    return float_or_none(est_.expected_remaining(g.get(), k, d));
  }

  nb::object remaining_for(nb::handle tid, nb::handle group) {
    const Text t(tid.ptr(), "trajectory_id");
    const OptText g(group.ptr(), "group_id");
    return float_or_none(est_.remaining_for(t.key, g.get()));
  }

  size_t num_tracked() const { return est_.num_tracked(); }

  void expire(nb::handle now) { est_.expire(float_of(now.ptr(), "now")); }

  nb::list group_ids() const {
    std::vector<std::string> ids;
    const auto& groups = est_.groups();
    for (int32_t s = groups.front(); s >= 0; s = groups.next(s)) ids.push_back(groups.key(s));
    nb::list out;
    for (const std::string& id : ids) out.append(str_of(id));
    return out;
  }

 private:
  wg::Estimator est_;
  nb::object config_;
  nb::object sample_type_;
  nb::object progress_type_;
};

}  // namespace

NB_MODULE(_progress, m) {
  m.doc() = "WAR native progress estimator of the router's war policy";
  // A router freezes its heap (war.aio.settle_heap), so its policy's estimator is
  // still alive when the interpreter exits: not a leak worth a warning.
  nb::set_leak_warnings(false);

  nb::class_<Estimator>(m, "ProgressEstimator",
                        "Tracks trajectories' progress and groups' finished samples; estimates\n"
                        "the remaining work of a trajectory (see war.router.policies.progress).")
      .def(nb::init<nb::handle, nb::handle, nb::handle>(), "config"_a.none(),
           "sample_type"_a.none(), "progress_type"_a.none())
      .def_prop_ro("config", &Estimator::config, "The ProgressConfig it was made with.")
      .def("begin", &Estimator::begin, "trajectory_id"_a.none(), "group_id"_a.none(),
           "now"_a.none(),
           "A request of the trajectory was sent. Returns remaining_for as it stood just\n"
           "before the call.")
      .def("observe", &Estimator::observe, "trajectory_id"_a.none(), "group_id"_a.none(),
           "generated_tokens"_a.none(), "now"_a.none(),
           "A turn of the trajectory completed with generated_tokens new tokens. Returns\n"
           "remaining_for after the call.")
      .def("abort", &Estimator::abort, "trajectory_id"_a.none(), "now"_a.none(),
           "A request of the trajectory failed (no turn was done).")
      .def("finish", &Estimator::finish, "trajectory_id"_a.none(), "now"_a.none(),
           "The trajectory ended: its totals become a finished sample of its group.")
      .def("add_sample", &Estimator::add_sample, "group_id"_a.none(), "turns"_a.none(),
           "tokens"_a.none(), "now"_a.none(), "trajectory_id"_a.none() = nb::none(),
           "Records a finished sample directly.")
      .def("progress", &Estimator::progress, "trajectory_id"_a.none(),
           "The trajectory's progress (a Progress), if tracked.")
      .def("samples", &Estimator::samples, "group_id"_a.none(),
           "The group's finished samples (None: the fleet-wide ones), oldest first.")
      .def("has_samples", &Estimator::has_samples, "group_id"_a.none(),
           "Whether the group (None: the fleet) has a finished sample.")
      .def("expected_remaining", &Estimator::expected_remaining, "group_id"_a.none(),
           "turns_done"_a.none(), "tokens_done"_a.none(),
           "Expected tokens still to generate by a trajectory of group_id that has done\n"
           "turns_done turns and tokens_done tokens; None when no finished sample is known.")
      .def("remaining_for", &Estimator::remaining_for, "trajectory_id"_a.none(),
           "group_id"_a.none(),
           "expected_remaining for a tracked trajectory's own progress (an unknown one:\n"
           "nothing done yet).")
      .def("num_tracked", &Estimator::num_tracked, "Trajectories tracked.")
      .def("expire", &Estimator::expire, "now"_a.none(),
           "Counts idle trajectories as finished after finish_idle_s and forgets\n"
           "trajectories not seen for trajectory_ttl_s.")
      .def("group_ids", &Estimator::group_ids,
           "Groups with samples kept, least recently updated first (for tests).");
}
