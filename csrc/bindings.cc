// Python bindings of the native core (module war.spec._C). The only Python
// module that imports it is war/spec/tree.py, which validates every input:
// these bindings assume well-formed arrays and ids.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

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

using Alpha = nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

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

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "WAR native core: suffix trees for speculative drafting";

  nb::class_<war::SuffixTree>(m, "SuffixTree")
      .def(nb::init<int32_t>(), "max_depth"_a)
      .def_prop_ro("max_depth", &war::SuffixTree::max_depth)
      .def_prop_ro("num_seqs", &war::SuffixTree::num_seqs)
      .def_prop_ro("num_nodes", &war::SuffixTree::num_nodes)
      .def_prop_ro("num_tokens", &war::SuffixTree::num_tokens)
      .def("append",
           [](war::SuffixTree& t, int64_t seq_id, Tokens tokens) {
             t.append(seq_id, tokens.data(), tokens.shape(0));
           },
           "seq_id"_a, "tokens"_a)
      .def("append_from", &war::SuffixTree::append_from, "seq_id"_a, "other"_a, "other_id"_a,
           "start"_a, "end"_a)
      .def("seal", &war::SuffixTree::seal, "seq_id"_a)
      .def("remove", &war::SuffixTree::remove, "seq_id"_a)
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

  m.def(
      "propose_batch",
      [](const std::vector<const war::SuffixTree*>& locals, Ids seq_ids,
         const std::vector<const war::SuffixTree*>& groups, const war::SuffixTree* global,
         nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> budgets,
         int32_t max_tokens, double factor, double offset, double min_prob, bool tree,
         Alpha alpha_group, Alpha alpha_local, Alpha alpha_global, double group_weight,
         bool merge, double merge_threshold, double merge_min_prob) {
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
        war::BatchResult r;
        {
          nb::gil_scoped_release release;
          war::propose_batch(items, global, params, group_weight, mp, &r);
        }
        return nb::make_tuple(to_numpy(std::move(r.tokens)), to_numpy(std::move(r.parents)),
                              to_numpy(std::move(r.probs)), to_numpy(std::move(r.offsets)),
                              to_numpy(std::move(r.scores)), to_numpy(std::move(r.sources)),
                              to_numpy(std::move(r.match_lens)));
      },
      "locals"_a, "seq_ids"_a, "groups"_a, "global_tree"_a.none(), "budgets"_a, "max_tokens"_a,
      "factor"_a, "offset"_a, "min_prob"_a, "tree"_a, "alpha_group"_a, "alpha_local"_a,
      "alpha_global"_a, "group_weight"_a, "merge"_a, "merge_threshold"_a, "merge_min_prob"_a);
}
