// Python bindings of the native core (module war.spec._C). The only Python
// module that imports it is war/spec/tree.py, which validates every input with
// its own messages; these bindings still refuse what would break memory safety
// (negative token ids, None trees, a depth beyond the limit, mutating a tree
// that a call without the GIL reads).
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <initializer_list>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "speculate.h"
#include "suffix_tree.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using Tokens = nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using Ids = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

template <typename T>
nb::ndarray<nb::numpy, T, nb::ndim<1>> to_numpy(std::vector<T>&& v) {
  auto* heap = new std::vector<T>(std::move(v));
  nb::capsule owner(heap, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T, nb::ndim<1>>(heap->data(), {heap->size()}, owner);
}

// The vectors' elements one after the other in a new bytearray.
template <typename T>
nb::object packed(std::initializer_list<const std::vector<T>*> parts) {
  size_t total = 0;
  for (const auto* v : parts) total += v->size() * sizeof(T);
  PyObject* b = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(total));
  if (b == nullptr) throw nb::python_error();
  char* out = PyByteArray_AS_STRING(b);
  for (const auto* v : parts) {
    if (!v->empty()) std::memcpy(out, v->data(), v->size() * sizeof(T));
    out += v->size() * sizeof(T);
  }
  return nb::steal(b);
}

using Alpha = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

constexpr int32_t kMaxDepth = 4096;  // war.spec.config.MAX_DEPTH

// A mutation of a tree that a call running without the GIL (another thread) reads
// would free what that call reads.
void check_unpinned(const war::SuffixTree& t) {
  if (t.pinned())
    throw std::runtime_error("suffix tree is in use by a call running without the GIL");
}

// Pins trees for the length of a call (unpinned in the destructor, with the GIL held).
class Pins {
 public:
  explicit Pins(std::vector<const war::SuffixTree*> trees) : trees_(std::move(trees)) {
    for (const auto* t : trees_) t->pin();
  }
  ~Pins() {
    for (const auto* t : trees_) t->unpin();
  }
  Pins(const Pins&) = delete;
  Pins& operator=(const Pins&) = delete;

 private:
  std::vector<const war::SuffixTree*> trees_;
};

// The trees of a sequence argument. `keep` takes a tuple of them, which holds
// them for the call: another thread may empty the caller's list while the GIL is
// released.
std::vector<const war::SuffixTree*> trees_of(nb::handle seq, const char* what,
                                             nb::object* keep) {
  PyObject* t = PySequence_Tuple(seq.ptr());
  if (t == nullptr) throw nb::python_error();
  *keep = nb::steal(t);
  const Py_ssize_t n = PyTuple_GET_SIZE(t);
  std::vector<const war::SuffixTree*> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    nb::handle h = PyTuple_GET_ITEM(t, i);
    if (!nb::isinstance<war::SuffixTree>(h) || !nb::inst_ready(h))
      throw nb::type_error((std::string("propose_batch: ") + what +
                            " must hold SuffixTree objects, got " + Py_TYPE(h.ptr())->tp_name)
                               .c_str());
    out[static_cast<size_t>(i)] = nb::inst_ptr<war::SuffixTree>(h);
  }
  return out;
}

// `alpha` holds one smoothing value per trie depth 0..max_depth (checked by the caller).
war::SpecParams make_params(int32_t max_tokens, double factor, double offset, double min_prob,
                            bool tree, const Alpha& alpha) {
  war::SpecParams p;
  p.max_tokens = max_tokens;
  p.factor = factor;
  p.offset = offset;
  p.min_prob = min_prob;
  p.tree = tree;
  p.alpha = alpha.data();
  p.alpha_nonincreasing = true;
  for (size_t d = 1; d < alpha.shape(0); ++d)
    if (!(alpha.data()[d] <= alpha.data()[d - 1])) p.alpha_nonincreasing = false;
  return p;
}

void check_alpha(const Alpha& alpha, const war::SuffixTree& t) {
  if (alpha.shape(0) < static_cast<size_t>(t.max_depth()) + 1)
    throw std::invalid_argument("alpha must hold max_depth + 1 values");
}

nb::tuple draft_tuple(war::DraftResult&& d) {
  const double score = d.score;
  const int32_t match_len = d.match_len;
  return nb::make_tuple(to_numpy(std::move(d.tokens)), to_numpy(std::move(d.parents)),
                        to_numpy(std::move(d.probs)), score, match_len);
}

// Owns a new reference; throws nb::python_error when the C API returned NULL.
nb::object checked(PyObject* o) {
  if (o == nullptr) throw nb::python_error();
  return nb::steal(o);
}

// A 1-D C-contiguous buffer of T (an integer or floating type of T's size),
// through the buffer protocol: cheaper than a nanobind ndarray argument.
template <typename T>
class Buf {
 public:
  Buf(nb::handle o, const char* what) {
    if (PyObject_GetBuffer(o.ptr(), &view_, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0)
      throw nb::python_error();
    const char* f = view_.format != nullptr ? view_.format : "B";
    if (*f == '<' || *f == '=' || *f == '@') ++f;
    // Floats 'e', 'f', 'd'; signed integers 'b', 'h', 'i', 'l', 'q'.
    const bool kind_ok = std::is_floating_point_v<T> ? std::strchr("efd", *f) != nullptr
                                                     : std::strchr("bhilq", *f) != nullptr;
    if (view_.ndim != 1 || view_.itemsize != static_cast<Py_ssize_t>(sizeof(T)) ||
        *f == '\0' || !kind_ok || f[1] != '\0') {
      PyBuffer_Release(&view_);  // (no destructor runs for a constructor that throws)
      throw std::invalid_argument(std::string("make_drafts: ") + what + " has the wrong type");
    }
    held_ = true;
  }
  ~Buf() {
    if (held_) PyBuffer_Release(&view_);
  }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  const T* data() const { return static_cast<const T*>(view_.buf); }
  size_t size() const { return static_cast<size_t>(view_.shape[0]); }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// Drafts (instances of `draft_type`, whose slots are `fields`: token_ids, parents,
// probs, score, source, match_len) from a batch's arrays (war.spec.tree.BatchDrafts).
// Instances are made as object.__new__ and object.__setattr__ make them (the type
// must have no __post_init__): the dataclass's own __init__ costs microseconds each.
nb::list make_drafts(nb::handle draft_type, nb::tuple fields, nb::tuple source_names,
                     nb::handle token_ids, nb::handle parents_, nb::handle probs_,
                     nb::handle offsets_, nb::handle scores_, nb::handle sources_,
                     nb::handle match_lens_) {
  if (!PyType_Check(draft_type.ptr()) || fields.size() != 6)
    throw std::invalid_argument("make_drafts: a type and its six field names expected");
  if (reinterpret_cast<PyTypeObject*>(draft_type.ptr())->tp_new == nullptr)
    throw nb::type_error("make_drafts: draft_type cannot be instantiated");
  const Buf<int32_t> tokens(token_ids, "token_ids"), parents(parents_, "parents");
  const Buf<double> probs(probs_, "probs"), scores(scores_, "scores");
  const Buf<int64_t> offsets(offsets_, "offsets");
  const Buf<int8_t> sources(sources_, "sources");
  const Buf<int32_t> match_lens(match_lens_, "match_lens");
  if (offsets.size() == 0) throw std::invalid_argument("make_drafts: no offsets");
  const size_t n = offsets.size() - 1;
  const int64_t* off = offsets.data();
  const size_t total = tokens.size();
  if (off[0] != 0 || off[n] != static_cast<int64_t>(total) || parents.size() != total ||
      probs.size() != total || scores.size() != n || sources.size() != n ||
      match_lens.size() != n)
    throw std::invalid_argument("make_drafts: array lengths disagree");
  for (size_t i = 0; i < n; ++i) {
    if (off[i + 1] < off[i]) throw std::invalid_argument("make_drafts: offsets decrease");
    if (sources.data()[i] < 0 || static_cast<size_t>(sources.data()[i]) >= source_names.size())
      throw std::invalid_argument("make_drafts: unknown source");
  }
  auto* type = reinterpret_cast<PyTypeObject*>(draft_type.ptr());
  nb::tuple no_args = nb::make_tuple();
  nb::list out;
  for (size_t i = 0; i < n; ++i) {
    const int64_t a = off[i], b = off[i + 1];
    nb::object tok = checked(PyTuple_New(b - a));
    nb::object par = checked(PyTuple_New(b - a));
    nb::object pro = checked(PyTuple_New(b - a));
    for (int64_t j = a; j < b; ++j) {
      PyTuple_SET_ITEM(tok.ptr(), j - a, checked(PyLong_FromLong(tokens.data()[j])).release().ptr());
      PyTuple_SET_ITEM(par.ptr(), j - a, checked(PyLong_FromLong(parents.data()[j])).release().ptr());
      PyTuple_SET_ITEM(pro.ptr(), j - a, checked(PyFloat_FromDouble(probs.data()[j])).release().ptr());
    }
    nb::object values[6] = {tok, par, pro, checked(PyFloat_FromDouble(scores.data()[i])),
                            nb::borrow(source_names[static_cast<size_t>(sources.data()[i])]),
                            checked(PyLong_FromLong(match_lens.data()[i]))};
    nb::object d = checked(type->tp_new(type, no_args.ptr(), nullptr));
    for (size_t f = 0; f < 6; ++f)
      if (PyObject_GenericSetAttr(d.ptr(), fields[f].ptr(), values[f].ptr()) != 0)
        throw nb::python_error();
    out.append(d);
  }
  return out;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "WAR native core: suffix trees for speculative drafting";

  nb::class_<war::SuffixTree>(m, "SuffixTree")
      .def("__init__",
           [](war::SuffixTree* t, int32_t max_depth) {
             // (each sequence holds max_depth pointers while it grows)
             if (max_depth > kMaxDepth)
               throw std::invalid_argument("max_depth must be <= " + std::to_string(kMaxDepth));
             new (t) war::SuffixTree(max_depth);
           },
           "max_depth"_a)
      .def_prop_ro("max_depth", &war::SuffixTree::max_depth)
      .def_prop_ro("num_seqs", &war::SuffixTree::num_seqs)
      .def_prop_ro("num_nodes", &war::SuffixTree::num_nodes)
      .def_prop_ro("num_tokens", &war::SuffixTree::num_tokens)
      .def("append",
           [](war::SuffixTree& t, int64_t seq_id, Tokens tokens) {
             check_unpinned(t);
             const int32_t* p = tokens.data();
             const size_t n = tokens.shape(0);
             // -1 marks an empty slot of the child index (flat_index.h)
             for (size_t i = 0; i < n; ++i)
               if (p[i] < 0)
                 throw std::invalid_argument("token id " + std::to_string(p[i]) +
                                             " is out of range [0, 2147483647]");
             t.append(seq_id, p, n);
           },
           "seq_id"_a, "tokens"_a)
      // A list or tuple of Python ints, read without a NumPy array: the few tokens
      // of a decoding step cost less this way. Returns false, having appended
      // nothing, when an item is not an int (bools included) in [0, 2**31 - 1]; the
      // caller then takes the validating path, which names the problem.
      .def("append_ints",
           [](war::SuffixTree& t, int64_t seq_id, nb::handle tokens) {
             check_unpinned(t);
             PyObject* seq = tokens.ptr();
             if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return false;
             const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
             PyObject** items = PySequence_Fast_ITEMS(seq);
             int32_t small[64];
             std::vector<int32_t> large;
             int32_t* buf = small;
             if (n > 64) {
               large.resize(static_cast<size_t>(n));
               buf = large.data();
             }
             for (Py_ssize_t i = 0; i < n; ++i) {
               PyObject* item = items[i];
               if (!PyLong_CheckExact(item)) return false;
               int overflow = 0;
               const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
               if (overflow != 0 || v < 0 || v > std::numeric_limits<int32_t>::max())
                 return false;
               buf[i] = static_cast<int32_t>(v);
             }
             t.append(seq_id, buf, static_cast<size_t>(n));
             return true;
           },
           "seq_id"_a, "tokens"_a)
      .def("append_from",
           [](war::SuffixTree& t, int64_t seq_id, const war::SuffixTree& other, int64_t other_id,
              int64_t start, int64_t end) {
             check_unpinned(t);
             t.append_from(seq_id, other, other_id, start, end);
           },
           "seq_id"_a, "other"_a, "other_id"_a, "start"_a, "end"_a)
      .def("seal",
           [](war::SuffixTree& t, int64_t seq_id) {
             check_unpinned(t);
             t.seal(seq_id);
           },
           "seq_id"_a)
      .def("remove",
           [](war::SuffixTree& t, int64_t seq_id) {
             check_unpinned(t);
             t.remove(seq_id);
           },
           "seq_id"_a)
      .def("contains", &war::SuffixTree::contains, "seq_id"_a)
      .def("seq_len", &war::SuffixTree::seq_len, "seq_id"_a)
      .def("sequence",
           [](const war::SuffixTree& t, int64_t seq_id) {
             return to_numpy(std::vector<int32_t>(t.sequence(seq_id)));
           },
           "seq_id"_a)
      .def("memory_bytes", &war::SuffixTree::memory_bytes)
      .def("count",
           [](const war::SuffixTree& t, Tokens path) {
             return t.count(path.data(), path.shape(0));
           },
           "path"_a)
      .def("children",
           [](const war::SuffixTree& t, Tokens path) {
             return t.children(path.data(), path.shape(0));
           },
           "path"_a)
      .def("match_len",
           [](const war::SuffixTree& t, Tokens ctx) {
             return t.match_len(ctx.data(), ctx.shape(0));
           },
           "context"_a)
      .def("speculate",
           [](const war::SuffixTree& t, Tokens ctx, int32_t max_tokens, double factor,
              double offset, double min_prob, bool tree, Alpha alpha) {
             check_alpha(alpha, t);
             war::DraftResult d;
             const Pins pins({&t});
             {
               nb::gil_scoped_release release;
               d = t.speculate(ctx.data(), ctx.shape(0),
                               make_params(max_tokens, factor, offset, min_prob, tree, alpha));
             }
             return draft_tuple(std::move(d));
           },
           "context"_a, "max_tokens"_a, "factor"_a, "offset"_a, "min_prob"_a, "tree"_a,
           "alpha"_a)
      .def("speculate_self",
           [](const war::SuffixTree& t, int64_t seq_id, int32_t max_tokens, double factor,
              double offset, double min_prob, bool tree, Alpha alpha) {
             check_alpha(alpha, t);
             return draft_tuple(t.speculate_self(
                 seq_id, make_params(max_tokens, factor, offset, min_prob, tree, alpha)));
           },
           "seq_id"_a, "max_tokens"_a, "factor"_a, "offset"_a, "min_prob"_a, "tree"_a,
           "alpha"_a)
      .def("check_integrity", &war::SuffixTree::check_integrity);

  m.def("make_drafts", &make_drafts, "draft_type"_a, "fields"_a, "source_names"_a,
        "token_ids"_a, "parents"_a, "probs"_a, "offsets"_a, "scores"_a, "sources"_a,
        "match_lens"_a);

  m.def(
      "propose_batch",
      [](nb::handle locals_, Ids seq_ids, nb::handle groups_, const war::SuffixTree* global,
         nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> budgets,
         int32_t max_tokens, double factor, double offset, double min_prob, bool tree,
         Alpha alpha_group, Alpha alpha_local, Alpha alpha_global, double group_weight,
         bool merge, double merge_threshold, double merge_min_prob) {
        nb::object keep_locals, keep_groups;
        const std::vector<const war::SuffixTree*> locals = trees_of(locals_, "locals", &keep_locals);
        const std::vector<const war::SuffixTree*> groups = trees_of(groups_, "groups", &keep_groups);
        const size_t n = locals.size();
        if (seq_ids.shape(0) != n || groups.size() != n || budgets.shape(0) != n)
          throw std::invalid_argument("propose_batch: argument lengths differ");
        std::vector<war::BatchItem> items(n);
        if (global != nullptr) check_alpha(alpha_global, *global);
        for (size_t i = 0; i < n; ++i) {
          check_alpha(alpha_local, *locals[i]);
          check_alpha(alpha_group, *groups[i]);
        }
        const war::SpecParams params[3] = {
            make_params(max_tokens, factor, offset, min_prob, tree, alpha_group),
            make_params(max_tokens, factor, offset, min_prob, tree, alpha_local),
            make_params(max_tokens, factor, offset, min_prob, tree, alpha_global)};
        for (size_t i = 0; i < n; ++i)
          items[i] = war::BatchItem{locals[i], seq_ids.data()[i], groups[i], budgets.data()[i]};
        war::MergeParams mp;
        mp.enabled = merge;
        mp.threshold = merge_threshold;
        mp.min_prob = merge_min_prob;
        std::vector<const war::SuffixTree*> read(locals);
        read.insert(read.end(), groups.begin(), groups.end());
        if (global != nullptr) read.push_back(global);
        const Pins pins(std::move(read));
        war::BatchResult r;
        {
          nb::gil_scoped_release release;
          war::propose_batch(items, global, params, group_weight, mp, &r);
        }
        // One bytearray per dtype, which the caller views as arrays: a NumPy array
        // made here costs microseconds each, most of a small batch's call.
        return nb::make_tuple(packed({&r.offsets}), packed({&r.tokens, &r.parents, &r.match_lens}),
                              packed({&r.probs, &r.scores}), packed({&r.sources}));
      },
      "locals"_a, "seq_ids"_a, "groups"_a, "global_tree"_a.none(), "budgets"_a, "max_tokens"_a,
      "factor"_a, "offset"_a, "min_prob"_a, "tree"_a, "alpha_group"_a, "alpha_local"_a,
      "alpha_global"_a, "group_weight"_a, "merge"_a, "merge_threshold"_a, "merge_min_prob"_a);
}
