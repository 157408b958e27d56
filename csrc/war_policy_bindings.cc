// Python bindings of the router's war policy (module
// war.router.policies._war_policy). The only Python module that imports it is
// war/router/policies/war_policy.py, which subclasses the class bound here.
//
// Knows: how the router passes things (a GenRequest read by attribute, ReplicaView
// named tuples read by index, replica names and ids as str, times as numbers,
// token ids as objects passed through to the tree unchanged), the WarPolicyConfig
// attribute names, the Python prefix tree and progress estimator the policy asks
// (their bound methods are cached at construction and called with vectorcall, in
// the reference's order, with the reference's arguments: the same objects), the
// pending path ends (request id -> the tree's PathEnd, the oldest forgotten
// beyond 65536, as PendingEnds), replica names <-> the core's dense ids, and the
// Decision type it builds. Does not know the rules (war_policy.h).
//
// Arguments are read and checked before the policy is touched, so a bad type
// raises TypeError / ValueError (a NaN time: ValueError) and leaves it as it was;
// an error raised by the tree or the estimator leaves the policy as the
// reference's would be at that point. Calls are short (microseconds), so the GIL
// is kept. The tree and the estimator must not call back into the policy (a
// re-entrant call raises RuntimeError).
#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "py_args.h"
#include "war_policy.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace wp = war::policy;

namespace {

using war::pyargs::float_of;
using war::pyargs::int_of;
using war::pyargs::OptText;
using war::pyargs::raise_type;
using war::pyargs::Text;
using war::pyargs::time_of;
using war::pyargs::utf8_of;

constexpr size_t kPendingEnds = 65536;  // as PendingEnds' capacity

bool truth_of(PyObject* o) {
  const int t = PyObject_IsTrue(o);
  if (t < 0) throw nb::python_error();
  return t != 0;
}

// A config number: an int stays an int (Python compares ints exactly), else a float.
wp::Num num_of(PyObject* o, const char* what) {
  if (PyLong_Check(o)) return wp::Num::of_int(int_of(o, what));
  if (PyFloat_Check(o)) return wp::Num::of_float(PyFloat_AS_DOUBLE(o));
  raise_type(what, "an int or a float", o);
}

std::optional<double> opt_float(PyObject* o, const char* what) {
  if (o == Py_None) return std::nullopt;
  return float_of(o, what);
}

nb::object attr(PyObject* o, PyObject* name) {
  PyObject* v = PyObject_GetAttr(o, name);
  if (v == nullptr) {
    if (PyErr_ExceptionMatches(PyExc_AttributeError)) {
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "%s has no attribute %U", Py_TYPE(o)->tp_name, name);
    }
    throw nb::python_error();
  }
  return nb::steal(v);
}

// Calls `f(args...)` (a cached bound method) with vectorcall.
template <class... A>
nb::object call(PyObject* f, A... args) {
  PyObject* argv[sizeof...(A) + 1] = {nullptr, args...};
  PyObject* r = PyObject_Vectorcall(f, argv + 1, sizeof...(A) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                    nullptr);
  if (r == nullptr) throw nb::python_error();
  return nb::steal(r);
}

struct Names {  // interned attribute names
  PyObject* request_id;
  PyObject* prompt_ids;
  PyObject* sampling;
  PyObject* max_tokens;
  PyObject* trajectory_id;
  PyObject* group_id;
  PyObject* continues;
  PyObject* output_ids;
};
Names g_names;

// What a call reads of a GenRequest.
struct RequestIn {
  RequestIn(PyObject* request, bool need_id)
      : tid_obj(attr(request, g_names.trajectory_id)),
        gid_obj(attr(request, g_names.group_id)),
        tid(tid_obj.ptr(), "trajectory_id"),
        gid(gid_obj.ptr(), "group_id") {
    continues = truth_of(attr(request, g_names.continues).ptr());
    prompt = attr(request, g_names.prompt_ids);
    nb::object sampling = attr(request, g_names.sampling);
    max_tokens = int_of(attr(sampling.ptr(), g_names.max_tokens).ptr(), "max_tokens");
    if (need_id) {
      rid_obj = attr(request, g_names.request_id);
      rid.emplace(rid_obj.ptr(), "request_id");
    }
  }

  nb::object tid_obj, gid_obj, prompt, rid_obj;
  OptText tid, gid;
  std::optional<Text> rid;
  bool continues = false;
  int64_t max_tokens = 0;
};

class Policy {
 public:
  Policy(nb::handle config, nb::handle tree, nb::handle progress, nb::handle decision_type)
      : core_(config_of(config)),
        config_(nb::borrow(config)),
        tree_(nb::borrow(tree)),
        progress_(nb::borrow(progress)),
        decision_(nb::borrow(decision_type)),
        insert_(nb::getattr(tree, "insert")),
        extend_(nb::getattr(tree, "extend")),
        match_(nb::getattr(tree, "match")),
        remove_replica_(nb::getattr(tree, "remove_replica")),
        begin_(nb::getattr(progress, "begin")),
        observe_(nb::getattr(progress, "observe")),
        abort_(nb::getattr(progress, "abort")),
        finish_(nb::getattr(progress, "finish")),
        has_samples_(nb::getattr(progress, "has_samples")),
        remaining_for_(nb::getattr(progress, "remaining_for")),
        expected_remaining_(nb::getattr(progress, "expected_remaining")),
        progress_of_(nb::getattr(progress, "progress")),
        zero_(nb::int_(0)),
        age_priority_(truth_of(nb::getattr(config, "age_priority").ptr())) {}

  nb::object config() const { return config_; }
  nb::object tree() const { return tree_; }
  nb::object progress() const { return progress_; }

  nb::object select(nb::handle request, nb::handle replicas, nb::handle now_obj) {
    Busy busy(this);
    const double now = time_of(now_obj.ptr());
    // A tuple of our own, not PySequence_Fast's view of a list: the views are read again
    // after Python code has run (a view's __bool__, the tree's and estimator's calls), and
    // that code may empty or resize the caller's list, freeing the array read here.
    PyObject* seq = PySequence_Tuple(replicas.ptr());
    if (seq == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
      PyErr_Clear();
      raise_type("replicas", "a sequence of ReplicaView", replicas.ptr());
    }
    const nb::object views = nb::steal(seq);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject** items = PySequence_Fast_ITEMS(seq);
    healthy_.clear();
    bufs_.clear();
    bufs_.reserve(static_cast<size_t>(n));  // (views into them stay valid)
    for (Py_ssize_t k = 0; k < n; ++k) {
      PyObject* v = items[k];
      if (!PyTuple_Check(v) || PyTuple_GET_SIZE(v) < 6) {
        raise_type("a replica", "a ReplicaView", v);
      }
      if (!truth_of(PyTuple_GET_ITEM(v, 1))) continue;
      wp::Replica r;
      bufs_.emplace_back();
      r.name = utf8_of(PyTuple_GET_ITEM(v, 0), "ReplicaView.name", &bufs_.back());
      r.input = static_cast<int32_t>(k);
      r.num_requests = int_of(PyTuple_GET_ITEM(v, 2), "ReplicaView.num_requests");
      r.tokens_in_flight = int_of(PyTuple_GET_ITEM(v, 3), "ReplicaView.tokens_in_flight");
      PyObject* free = PyTuple_GET_ITEM(v, 4);
      PyObject* total = PyTuple_GET_ITEM(v, 5);
      r.has_free = free != Py_None;
      if (r.has_free) r.free = int_of(free, "ReplicaView.kv_free_tokens");
      r.has_total = total != Py_None;
      if (r.has_total) r.total = int_of(total, "ReplicaView.kv_total_tokens");
      healthy_.push_back(r);
    }
    if (healthy_.empty()) throw nb::value_error("no healthy replica to choose from");
    RequestIn q(request.ptr(), false);
    wp::Request req;
    req.tid = q.tid.get();
    req.group = q.gid.get();
    req.continues = q.continues;
    req.max_tokens = q.max_tokens;
    const Py_ssize_t len = PyObject_Size(q.prompt.ptr());
    if (len < 0) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
      PyErr_Clear();
      raise_type("prompt_ids", "a sequence of ints", q.prompt.ptr());
    }
    req.prompt_len = static_cast<int64_t>(len);
    if (!q.continues) {
      q.rid_obj = attr(request.ptr(), g_names.request_id);
      q.rid.emplace(q.rid_obj.ptr(), "request_id");
    }
    for (wp::Replica& r : healthy_) r.id = id_of_name(PyTuple_GET_ITEM(items[r.input], 0), r.name);

    Outside out(this, &q, items, now_obj.ptr());
    bool migrated = false;
    const wp::Replica* choice = core_.select(req, &healthy_, now, &out, &migrated);
    PyObject* name = PyTuple_GET_ITEM(items[choice->input], 0);
    nb::object priority = nb::none();
    if (req.tid != nullptr) {
      if (core_.config().progress_priority) {
        priority = out.begun;
        if (age_priority_) priority = at_least_done(q.tid_obj.ptr(), std::move(priority));
      }
    } else if (core_.config().progress_priority && req.group != nullptr) {
      priority = call(expected_remaining_.ptr(), q.gid_obj.ptr(), zero_.ptr(), zero_.ptr());
    }
    return call(decision_.ptr(), name, priority.ptr(), migrated ? Py_True : Py_False);
  }

  void on_complete(nb::handle request, nb::handle result, nb::handle replica,
                   nb::handle now_obj) {
    Busy busy(this);
    RequestIn q(request.ptr(), true);
    const bool done = !result.is_none();
    nb::object output;
    std::string buf;
    std::string_view replica_name;
    double now = 0.0;
    if (done) {
      output = attr(result.ptr(), g_names.output_ids);
      replica_name = utf8_of(replica.ptr(), "replica", &buf);
      now = time_of(now_obj.ptr());
    }
    const nb::object end = pop_end(q.rid->key);
    if (!done) {
      if (q.tid.get() != nullptr) call(abort_.ptr(), q.tid_obj.ptr(), now_obj.ptr());
      return;
    }
    if (!q.continues) {
      call(extend_.ptr(), end.ptr(), q.prompt.ptr(), output.ptr(), replica.ptr(), now_obj.ptr());
    }
    if (q.tid.get() == nullptr) return;
    const Py_ssize_t generated = PyObject_Size(output.ptr());
    if (generated < 0) throw nb::python_error();
    const nb::object n = nb::steal(PyLong_FromSsize_t(generated));
    const nb::object remaining =
        call(observe_.ptr(), q.tid_obj.ptr(), q.gid_obj.ptr(), n.ptr(), now_obj.ptr());
    const std::optional<double> rem = opt_float(remaining.ptr(), "observe's result");
    core_.complete(*q.tid.get(), id_of_name(replica.ptr(), replica_name), generated,
                   q.max_tokens, rem, now);
  }

  nb::dict committed_work() const {
    nb::dict out;
    for (const auto& [id, work] : core_.committed_work()) {
      out[names_[static_cast<size_t>(id)]] = nb::steal(PyFloat_FromDouble(work));
    }
    return out;
  }

  void on_replica_down(nb::handle replica, nb::handle /*now*/) {
    Busy busy(this);
    std::string buf;
    const std::string_view name = utf8_of(replica.ptr(), "replica", &buf);
    const auto it = ids_.find(std::string(name));
    if (it != ids_.end()) core_.drop_commitments(it->second);
    call(remove_replica_.ptr(), replica.ptr());
    if (it != ids_.end()) core_.drop_placements(it->second);
  }

  void finish_trajectory(nb::handle tid, nb::handle now) {
    Busy busy(this);
    const Text t(tid.ptr(), "trajectory_id");
    call(finish_.ptr(), tid.ptr(), now.ptr());
    core_.forget(t.key);
  }

  size_t num_trajectories() const { return core_.num_trajectories(); }
  size_t num_pending_ends() const { return ends_.size(); }

  nb::tuple stats() const {
    const wp::Stats& s = core_.stats();
    return nb::make_tuple(s.sticky, s.migrations, s.failovers, s.co_located, s.spread);
  }

 private:
  // Rule 4's floor (age_priority): `priority` (begin's estimate, or None) raised to the
  // tokens the trajectory has generated so far, compared and converted as the
  // reference does (Python's int/float comparison, float(tokens)).
  nb::object at_least_done(PyObject* tid, nb::object priority) {
    const nb::object done = call(progress_of_.ptr(), tid);
    if (done.is_none()) return priority;
    const nb::object tokens = nb::getattr(done, "tokens");
    const int positive = PyObject_RichCompareBool(tokens.ptr(), zero_.ptr(), Py_GT);
    if (positive < 0) throw nb::python_error();
    if (positive == 0) return priority;
    if (!priority.is_none()) {
      const int more = PyObject_RichCompareBool(tokens.ptr(), priority.ptr(), Py_GT);
      if (more < 0) throw nb::python_error();
      if (more == 0) return priority;
    }
    PyObject* f = PyNumber_Float(tokens.ptr());
    if (f == nullptr) throw nb::python_error();
    return nb::steal(f);
  }

  // Marks a call in progress (a re-entrant one raises).
  class Busy {
   public:
    explicit Busy(Policy* p) : p_(p) {
      if (p_->busy_) throw std::runtime_error("WarPolicy called again from inside a call");
      p_->busy_ = true;
    }
    ~Busy() { p_->busy_ = false; }
    Busy(const Busy&) = delete;
    Busy& operator=(const Busy&) = delete;

   private:
    Policy* p_;
  };

  // The tree and the estimator, as `select` asks them.
  class Outside final : public wp::Outside {
   public:
    Outside(Policy* p, RequestIn* q, PyObject** views, PyObject* now)
        : p_(p), q_(q), views_(views), now_(now) {}

    bool has_samples() override {
      return truth_of(call(p_->has_samples_.ptr(), q_->gid_obj.ptr()).ptr());
    }

    bool match(const std::vector<const wp::Replica*>& cands,
               std::vector<int64_t>* lens) override {
      const nb::object m = call(p_->match_.ptr(), q_->prompt.ptr());
      if (!PyDict_Check(m.ptr())) raise_type("tree.match's result", "a dict", m.ptr());
      if (PyDict_GET_SIZE(m.ptr()) == 0) return false;
      for (size_t k = 0; k < cands.size(); ++k) {
        PyObject* name = PyTuple_GET_ITEM(views_[cands[k]->input], 0);
        PyObject* v = PyDict_GetItemWithError(m.ptr(), name);
        if (v == nullptr) {
          if (PyErr_Occurred()) throw nb::python_error();
          (*lens)[k] = 0;
        } else {
          (*lens)[k] = int_of(v, "a matched length");
        }
      }
      return true;
    }

    std::optional<double> remaining_for() override {
      const nb::object r = call(p_->remaining_for_.ptr(), q_->tid_obj.ptr(), q_->gid_obj.ptr());
      return opt_float(r.ptr(), "remaining_for's result");
    }

    std::optional<double> expected_remaining_fleet() override {
      const nb::object r =
          call(p_->expected_remaining_.ptr(), Py_None, p_->zero_.ptr(), p_->zero_.ptr());
      return opt_float(r.ptr(), "expected_remaining's result");
    }

    void insert(const wp::Replica& choice) override {
      PyObject* name = PyTuple_GET_ITEM(views_[choice.input], 0);
      nb::object end = call(p_->insert_.ptr(), q_->prompt.ptr(), name, now_);
      p_->put_end(q_->rid->key, std::move(end));
    }

    std::optional<double> begin() override {
      begun = call(p_->begin_.ptr(), q_->tid_obj.ptr(), q_->gid_obj.ptr(), now_);
      return opt_float(begun.ptr(), "begin's result");
    }

    nb::object begun = nb::none();

   private:
    Policy* p_;
    RequestIn* q_;
    PyObject** views_;
    PyObject* now_;
  };

  static wp::Config config_of(nb::handle config) {
    auto get = [&](const char* name) { return nb::getattr(config, name); };
    wp::Config c;
    c.migrate_abs_tokens = num_of(get("migrate_abs_tokens").ptr(), "migrate_abs_tokens");
    c.migrate_rel = num_of(get("migrate_rel").ptr(), "migrate_rel");
    c.migrate_own_weight = num_of(get("migrate_own_weight").ptr(), "migrate_own_weight");
    c.migrate_needs_room = truth_of(get("migrate_needs_room").ptr());
    c.group_abs_tokens = num_of(get("group_abs_tokens").ptr(), "group_abs_tokens");
    c.group_rel = num_of(get("group_rel").ptr(), "group_rel");
    c.group_abs_requests = num_of(get("group_abs_requests").ptr(), "group_abs_requests");
    c.group_work_slack = num_of(get("group_work_slack").ptr(), "group_work_slack");
    c.spread_unknown_groups = truth_of(get("spread_unknown_groups").ptr());
    c.group_match_threshold =
        num_of(get("group_match_threshold").ptr(), "group_match_threshold");
    c.trajectory_ttl_s = float_of(get("trajectory_ttl_s").ptr(), "trajectory_ttl_s");
    c.max_trajectories = int_of(get("max_trajectories").ptr(), "max_trajectories");
    c.progress_priority = truth_of(get("progress_priority").ptr());
    nb::object progress = get("progress");
    c.finish_idle_s = float_of(nb::getattr(progress, "finish_idle_s").ptr(), "finish_idle_s");
    if (c.max_trajectories < 1) throw nb::value_error("max_trajectories must be >= 1");
    return c;
  }

  // The dense id of a replica name (`name`: the str, `bytes`: its UTF-8).
  int32_t id_of_name(PyObject* name, std::string_view bytes) {
    key_.assign(bytes.data(), bytes.size());
    const auto it = ids_.find(key_);
    if (it != ids_.end()) return it->second;
    const auto id = static_cast<int32_t>(names_.size());
    names_.push_back(nb::borrow(name));
    ids_.emplace(key_, id);
    return id;
  }

  void put_end(const wp::Key& rid, nb::object end) {
    const int32_t s = ends_.find(rid);
    if (s != wp::OrderedMap<nb::object>::kNone) ends_.erase(s);
    ends_.push_back(rid, std::move(end));
    if (ends_.size() > kPendingEnds) ends_.erase(ends_.front());
  }

  nb::object pop_end(const wp::Key& rid) {
    const int32_t s = ends_.find(rid);
    if (s == wp::OrderedMap<nb::object>::kNone) return nb::none();
    nb::object end = std::move(ends_.value(s));
    ends_.erase(s);
    return end;
  }

  wp::Policy core_;
  nb::object config_, tree_, progress_, decision_;
  nb::object insert_, extend_, match_, remove_replica_;
  nb::object begin_, observe_, abort_, finish_, has_samples_, remaining_for_,
      expected_remaining_;
  nb::object progress_of_;
  nb::object zero_;
  bool age_priority_;
  wp::OrderedMap<nb::object> ends_;  // request id -> PathEnd, oldest first
  std::unordered_map<std::string, int32_t> ids_;
  std::vector<nb::object> names_;  // id -> the name, as first seen
  std::string key_;
  std::vector<wp::Replica> healthy_;
  std::vector<std::string> bufs_;
  bool busy_ = false;
};

}  // namespace

NB_MODULE(_war_policy, m) {
  m.doc() = "WAR native war routing policy (rules and bookkeeping)";
  // A router freezes its heap (war.aio.settle_heap), so its policy is still alive
  // when the interpreter exits: not a leak worth a warning.
  nb::set_leak_warnings(false);
  g_names = Names{PyUnicode_InternFromString("request_id"),
                  PyUnicode_InternFromString("prompt_ids"),
                  PyUnicode_InternFromString("sampling"),
                  PyUnicode_InternFromString("max_tokens"),
                  PyUnicode_InternFromString("trajectory_id"),
                  PyUnicode_InternFromString("group_id"),
                  PyUnicode_InternFromString("continues"),
                  PyUnicode_InternFromString("output_ids")};

  nb::class_<Policy>(m, "WarPolicy",
                     "The war policy's rules and bookkeeping (see\n"
                     "war.router.policies.war_policy).")
      .def(nb::init<nb::handle, nb::handle, nb::handle, nb::handle>(), "config"_a.none(),
           "tree"_a.none(), "progress"_a.none(), "decision_type"_a.none())
      .def_prop_ro("config", &Policy::config, "The WarPolicyConfig it was made with.")
      .def_prop_ro("tree", &Policy::tree, "The prefix tree it asks.")
      .def_prop_ro("progress", &Policy::progress, "The progress estimator it asks.")
      .def("select", &Policy::select, "request"_a.none(), "replicas"_a.none(), "now"_a.none(),
           "Where the request goes (a Decision).")
      .def("on_complete", &Policy::on_complete, "request"_a.none(), "result"_a.none(),
           "replica"_a.none(), "now"_a.none(),
           "The request completed on replica (result None: it failed).")
      .def("committed_work", &Policy::committed_work,
           "Expected remaining tokens of the trajectories placed on each replica.")
      .def("on_replica_down", &Policy::on_replica_down, "replica"_a.none(), "now"_a.none(),
           "Drops the replica's tree, commitments and the stickiness to it.")
      .def("finish_trajectory", &Policy::finish_trajectory, "trajectory_id"_a.none(),
           "now"_a.none(), "The trajectory ended.")
      .def("num_trajectories", &Policy::num_trajectories,
           "Trajectories whose placement is remembered.")
      .def("_num_pending_ends", &Policy::num_pending_ends,
           "Requests routed and not completed whose path end is kept (for tests).")
      .def("_stats", &Policy::stats,
           "(sticky, migrations, failovers, co_located, spread) counts.");
}
