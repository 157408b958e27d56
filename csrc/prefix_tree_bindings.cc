// Python bindings of the router's prefix tree (module
// war.router.policies._prefix_tree). The only Python module that imports it is
// war/router/policies/prefix_tree.py.
//
// Knows: how Python callers pass things (token ids as any iterable of ints,
// replica names as str, times as numbers) and how to turn them into the
// tree's ints and doubles; replica names <-> the tree's dense replica ids.
// Every argument is converted and checked before the tree is touched, so a
// bad call raises (TypeError / ValueError) and leaves the tree as it was.
// Does not know the tree's algorithm (prefix_tree.h).
//
// Calls are short (a few microseconds), so the GIL is kept: releasing and
// taking it back would cost about as much as the work.
#include <nanobind/nanobind.h>

#include <climits>
#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "prefix_tree.h"
#include "py_args.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace wp = war::prefix;

namespace {

using war::pyargs::float_of;
using war::pyargs::time_of;

// An opaque handle to the end of an inserted path: the tree it belongs to and
// a node slot with the generation it had (prefix_tree.h).
struct PathEnd {
  uint64_t tree;
  int32_t node;
  uint64_t gen;
};

uint64_t g_next_tree_uid = 1;  // under the GIL

std::string repr(PyObject* o) {
  PyObject* r = PyObject_Repr(o);
  if (r == nullptr) {
    PyErr_Clear();
    return "?";
  }
  const char* s = PyUnicode_AsUTF8(r);
  std::string out = s != nullptr ? s : "?";
  if (s == nullptr) PyErr_Clear();
  Py_DECREF(r);
  return out;
}

// An int token id in int32 range; `o` is an int (or bool) object.
wp::Token token_of_long(PyObject* o) {
  int overflow = 0;
  const long v = PyLong_AsLongAndOverflow(o, &overflow);
  if (overflow != 0 || v < INT32_MIN || v > INT32_MAX) {
    if (v == -1 && PyErr_Occurred()) throw nb::python_error();
    throw nb::value_error(("token id " + repr(o) + " does not fit in int32").c_str());
  }
  return static_cast<wp::Token>(v);
}

// The value of an int object that fits in one digit (|v| < 2**30), read without
// a call: most token ids (reading them dominates a call's cost otherwise).
inline bool compact_value(PyObject* o, long* v) {
#if PY_VERSION_HEX >= 0x030C0000
  auto* l = reinterpret_cast<PyLongObject*>(o);
  if (!PyUnstable_Long_IsCompact(l)) return false;
  *v = static_cast<long>(PyUnstable_Long_CompactValue(l));
  return true;
#else
  const Py_ssize_t size = Py_SIZE(o);  // the sign and number of digits
  if (size < -1 || size > 1) return false;
  *v = size == 0 ? 0 : static_cast<long>(size) *
                           static_cast<long>(reinterpret_cast<PyLongObject*>(o)->ob_digit[0]);
  return true;
#endif
}

// Any other object that Python accepts as an index (numpy integers).
wp::Token token_of_other(PyObject* o) {
  PyObject* idx = PyNumber_Index(o);
  if (idx == nullptr) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
    PyErr_Clear();
    throw nb::type_error(
        ("token ids must be ints, got " + std::string(Py_TYPE(o)->tp_name)).c_str());
  }
  wp::Token t;
  try {
    t = token_of_long(idx);
  } catch (...) {
    Py_DECREF(idx);
    throw;
  }
  Py_DECREF(idx);
  return t;
}

// Appends the token ids of `seq` (any iterable of ints, as tuple() takes) to
// `out`; on error `out` is left as it was.
void append_tokens(PyObject* seq, std::vector<wp::Token>* out) {
  const size_t base = out->size();
  PyObject* fast;
  if (PyTuple_CheckExact(seq) || PyList_CheckExact(seq)) {
    fast = seq;
    Py_INCREF(fast);
  } else {
    fast = PySequence_Fast(seq, "tokens must be an iterable of ints");
    if (fast == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
      PyErr_Clear();
      throw nb::type_error(("tokens must be an iterable of ints, got " +
                            std::string(Py_TYPE(seq)->tp_name)).c_str());
    }
  }
  try {
    for (;;) {
      const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
      PyObject** items = PySequence_Fast_ITEMS(fast);
      out->resize(base + static_cast<size_t>(n));
      wp::Token* dst = out->data() + base;
      bool restart = false;
      for (Py_ssize_t i = 0; i < n; ++i) {
        PyObject* o = items[i];
        long v;
        if (PyLong_CheckExact(o) && compact_value(o, &v) && v >= INT32_MIN && v <= INT32_MAX) {
          dst[i] = static_cast<wp::Token>(v);
        } else if (PyLong_CheckExact(o)) {
          dst[i] = token_of_long(o);
        } else if (PyList_CheckExact(fast)) {
          // Converting other objects runs Python code that could change the
          // list under us: go on from a snapshot.
          PyObject* snap = PyList_AsTuple(fast);
          if (snap == nullptr) throw nb::python_error();
          Py_DECREF(fast);
          fast = snap;
          restart = true;
          break;
        } else {
          dst[i] = PyLong_Check(o) ? token_of_long(o) : token_of_other(o);
        }
      }
      if (!restart) break;
    }
  } catch (...) {
    out->resize(base);
    Py_DECREF(fast);
    throw;
  }
  Py_DECREF(fast);
}

// The router's fast check of a prompt (see its docstring in the module below). Reads
// the items without running Python code, so the sequence cannot change meanwhile.
bool plain_token_ids(nb::handle tokens) {
  PyObject* seq = tokens.ptr();
  if (!PyTuple_CheckExact(seq) && !PyList_CheckExact(seq)) return false;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  PyObject** items = PySequence_Fast_ITEMS(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long v;
    if (!PyLong_CheckExact(items[i]) || !compact_value(items[i], &v) || v < 0) return false;
  }
  return true;
}

void check_name(PyObject* o) {
  if (!PyUnicode_Check(o))
    throw nb::type_error(
        ("replica must be a str, got " + std::string(Py_TYPE(o)->tp_name)).c_str());
}

// A token buffer borrowed from a pool for one call. Converting tokens can run
// Python code (an iterator, a numpy scalar's __index__), which may re-enter the
// tree or let another thread call it: each call has its own buffer, and state
// of the tree is read only after all conversions are done.
class Lease {
 public:
  explicit Lease(std::vector<std::vector<wp::Token>>* pool) : pool_(pool) {
    if (!pool->empty()) {
      buf_ = std::move(pool->back());
      pool->pop_back();
    }
    buf_.clear();
  }
  ~Lease() { pool_->push_back(std::move(buf_)); }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  std::vector<wp::Token>& operator*() { return buf_; }
  std::vector<wp::Token>* operator->() { return &buf_; }

 private:
  std::vector<std::vector<wp::Token>>* pool_;
  std::vector<wp::Token> buf_;
};

class Tree {
 public:
  explicit Tree(nb::handle budget)
      : tree_(check_budget(budget)), budget_(nb::borrow(budget)), uid_(g_next_tree_uid++) {
    pool_.reserve(4);
  }

  nb::object max_tokens_per_replica() const { return budget_; }

  nb::dict match(nb::handle tokens) {
    std::vector<std::pair<int32_t, int64_t>> matched = std::move(matched_);  // keeps capacity
    {
      Lease toks(&pool_);
      append_tokens(tokens.ptr(), &*toks);
      tree_.match(toks->data(), toks->size(), &matched);
    }
    nb::dict out;
    for (const auto& [r, len] : matched) {
      PyObject* v = PyLong_FromLongLong(len);
      if (v == nullptr ||
          PyDict_SetItem(out.ptr(), names_[static_cast<size_t>(r)].ptr(), v) != 0) {
        Py_XDECREF(v);
        throw nb::python_error();
      }
      Py_DECREF(v);
    }
    matched_ = std::move(matched);
    return out;
  }

  int64_t num_tokens(nb::handle replica) const { return tree_.num_tokens(find(replica)); }

  nb::list replicas() const {
    std::vector<nb::object> held;
    for (size_t r = 0; r < names_.size(); ++r)
      if (tree_.num_tokens(static_cast<int32_t>(r)) > 0) held.push_back(names_[r]);
    nb::list out;
    for (const nb::object& name : held) out.append(name);
    if (PyList_Sort(out.ptr()) != 0) throw nb::python_error();
    return out;
  }

  nb::object insert(nb::handle tokens, nb::handle replica, nb::handle now) {
    Lease toks(&pool_);
    append_tokens(tokens.ptr(), &*toks);
    check_name(replica.ptr());
    const double t = time_of(now.ptr());
    if (toks->empty()) return nb::none();
    const int32_t r = intern(replica);
    return end_of(tree_.insert(toks->data(), toks->size(), r, t));
  }

  nb::object extend(nb::handle end, nb::handle path, nb::handle tokens, nb::handle replica,
                    nb::handle now) {
    const PathEnd* pe = nullptr;
    if (!end.is_none()) {
      if (!nb::isinstance<PathEnd>(end))
        throw nb::type_error(("end must be a PathEnd or None, got " +
                              std::string(Py_TYPE(end.ptr())->tp_name)).c_str());
      pe = nb::inst_ptr<PathEnd>(end);
    }
    Lease toks(&pool_);
    append_tokens(tokens.ptr(), &*toks);
    check_name(replica.ptr());
    const double t = time_of(now.ptr());
    const int32_t r = intern(replica);
    // No Python code runs from here on but in the detached branch's conversion,
    // after which nothing read from the tree before is used.
    const wp::Handle h = pe != nullptr ? wp::Handle{pe->node, pe->gen} : wp::Handle{};
    if (pe != nullptr && pe->tree == uid_ && tree_.attached(h))
      return end_of(tree_.extend(h, toks->data(), toks->size(), r, t));
    Lease whole(&pool_);  // detached or None: insert path + tokens from the root
    append_tokens(path.ptr(), &*whole);
    whole->insert(whole->end(), toks->begin(), toks->end());
    if (whole->empty()) return nb::none();
    return end_of(tree_.insert(whole->data(), whole->size(), r, t));
  }

  int64_t evict(nb::handle replica, nb::handle max_tokens) {
    const double m = float_of(max_tokens.ptr(), "max_tokens");
    return tree_.evict(find(replica), m);
  }

  void remove_replica(nb::handle replica) { tree_.remove_replica(find(replica)); }

  void check_integrity() const {
    tree_.check_integrity();
    if (tree_.num_replica_ids() != names_.size() ||
        static_cast<size_t>(PyDict_Size(ids_.ptr())) != names_.size())
      throw wp::IntegrityError("replica names");
  }

  // (paths, num_tokens, num_nodes) as the reference's `dump`.
  nb::tuple dump() const {
    std::vector<std::pair<std::vector<wp::Token>, std::vector<wp::Holder>>> nodes;
    tree_.dump(&nodes);
    std::vector<std::tuple<nb::object, int64_t, int64_t>> counts;
    for (size_t r = 0; r < names_.size(); ++r) {
      const auto ri = static_cast<int32_t>(r);
      if (tree_.known(ri))
        counts.emplace_back(names_[r], tree_.num_tokens(ri), tree_.num_nodes(ri));
    }
    std::vector<nb::object> names = names_;
    nb::list paths;
    for (const auto& [path, holders] : nodes) {
      nb::list p;
      for (wp::Token t : path) p.append(nb::int_(t));
      nb::list hs;
      for (const wp::Holder& h : holders)
        hs.append(nb::make_tuple(names[static_cast<size_t>(h.replica)], h.time));
      paths.append(nb::make_tuple(nb::tuple(p), nb::tuple(hs)));
    }
    if (PyList_Sort(paths.ptr()) != 0) throw nb::python_error();
    nb::dict tokens, num_nodes;
    for (const auto& [name, n_tokens, n_nodes] : counts) {
      tokens[name] = n_tokens;
      num_nodes[name] = n_nodes;
    }
    return nb::make_tuple(paths, tokens, num_nodes);
  }

  // The replica's heap of leaf candidates as (touch time, push order), in array order.
  nb::list heap_entries(nb::handle replica) const {
    const std::vector<wp::HeapEntry> heap = tree_.heap(find(replica));  // a copy
    nb::list out;
    for (const wp::HeapEntry& e : heap) out.append(nb::make_tuple(e.time, e.seq));
    return out;
  }

  size_t heap_size(nb::handle replica) const { return tree_.heap(find(replica)).size(); }

 private:
  static double check_budget(nb::handle b) {
    if (PyBool_Check(b.ptr()))
      throw nb::value_error(
          ("max_tokens_per_replica must be >= 1, got " + repr(b.ptr())).c_str());
    const double v = float_of(b.ptr(), "max_tokens_per_replica");
    if (v < 1)  // NaN passes, as it does in the reference (nothing is ever evicted)
      throw nb::value_error(
          ("max_tokens_per_replica must be >= 1, got " + repr(b.ptr())).c_str());
    return v;
  }

  // The id of a replica name, -1 if unknown.
  int32_t find(nb::handle name) const {
    PyObject* v = PyDict_GetItemWithError(ids_.ptr(), name.ptr());
    if (v == nullptr) {
      if (PyErr_Occurred()) throw nb::python_error();
      return -1;
    }
    return static_cast<int32_t>(PyLong_AsLong(v));
  }

  // The id of a replica name (a str), given one if new. Names are kept as exact
  // str, so using them as dict keys later runs no Python code.
  int32_t intern(nb::handle name) {
    const int32_t known = find(name);
    if (known >= 0) return known;
    nb::object key = PyUnicode_CheckExact(name.ptr())
                         ? nb::borrow(name)
                         : nb::steal(PyUnicode_FromObject(name.ptr()));
    if (!key.is_valid()) throw nb::python_error();
    const auto r = static_cast<int32_t>(names_.size());
    nb::object id = nb::int_(r);
    if (PyDict_SetItem(ids_.ptr(), key.ptr(), id.ptr()) != 0) throw nb::python_error();
    names_.push_back(key);
    tree_.ensure_replica(r);
    return r;
  }

  nb::object end_of(const wp::Handle& h) const {
    return nb::cast(PathEnd{uid_, h.node, h.gen}, nb::rv_policy::move);
  }

  wp::PrefixTree tree_;
  nb::object budget_;
  uint64_t uid_;
  nb::dict ids_;                   // replica name -> id
  std::vector<nb::object> names_;  // id -> replica name
  std::vector<std::vector<wp::Token>> pool_;  // token buffers (Lease)
  std::vector<std::pair<int32_t, int64_t>> matched_;
};

}  // namespace

NB_MODULE(_prefix_tree, m) {
  m.doc() = "WAR native prefix tree of the router's cache-aware policies";
  // A router freezes its heap (war.aio.settle_heap), so its policies' trees are
  // still alive when the interpreter exits: not leaks worth a warning.
  nb::set_leak_warnings(false);

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const wp::IntegrityError& e) {
      PyErr_SetString(PyExc_AssertionError, e.what());
    }
  });

  m.def("plain_token_ids", &plain_token_ids, "tokens"_a.none(),
        "Whether tokens is a list or tuple of plain ints (not bools) in [0, 2**30): the\n"
        "common shape of a prompt, checked without a Python step per token. False says\n"
        "nothing about the tokens; check them another way then.");

  nb::class_<PathEnd>(m, "PathEnd",
                      "Where an inserted path ends (opaque; for PrefixTree.extend).");

  nb::class_<Tree>(m, "PrefixTree",
                   "Token prefixes held by each replica, bounded to max_tokens_per_replica\n"
                   "tokens per replica (least recently used leaves are evicted first).")
      .def(nb::init<nb::handle>(), "max_tokens_per_replica"_a.none())
      .def_prop_ro("max_tokens_per_replica", &Tree::max_tokens_per_replica)
      .def("match", &Tree::match, "tokens"_a.none(),
           "The longest prefix of tokens that each replica holds (replicas that hold\n"
           "none are absent).")
      .def("num_tokens", &Tree::num_tokens, "replica"_a.none(),
           "Tokens of the tree that replica holds (0 if unknown).")
      .def("replicas", &Tree::replicas, "Replicas holding anything, sorted by name.")
      .def("insert", &Tree::insert, "tokens"_a.none(), "replica"_a.none(), "now"_a.none(),
           "Records that replica holds tokens (touched at now), then evicts its least\n"
           "recently used leaves while it is over budget. Returns the end of the path\n"
           "(for extend; None for no tokens).")
      .def("extend", &Tree::extend, "end"_a.none(), "path"_a.none(), "tokens"_a.none(),
           "replica"_a.none(), "now"_a.none(),
           "insert(path + tokens), where end is what insert(path) returned: touches the\n"
           "path's nodes and appends tokens from end without reading path. When end is\n"
           "None or no longer in the tree, inserts path + tokens from the root instead.")
      .def("evict", &Tree::evict, "replica"_a.none(), "max_tokens"_a.none(),
           "Evicts replica's least recently used leaves until it holds at most\n"
           "max_tokens tokens; returns the number of tokens evicted.")
      .def("remove_replica", &Tree::remove_replica, "replica"_a.none(),
           "Forgets everything replica holds.")
      .def("check_integrity", &Tree::check_integrity,
           "Raises AssertionError if an invariant is broken (expensive; for tests).")
      .def("dump", &Tree::dump,
           "(every path with its holders in the order they came, sorted by path; the\n"
           "per-replica token counts; the per-replica node counts), for tests.")
      .def("heap_entries", &Tree::heap_entries, "replica"_a.none(),
           "replica's heap of leaf candidates as (touch time, push order), for tests.")
      .def("heap_size", &Tree::heap_size, "replica"_a.none(),
           "Entries in replica's heap of leaf candidates.");
}
