// A token -> child map for nodes with many children: open addressing with
// linear probing in two flat arrays, so a lookup touches one or two cache lines
// (a node-based hash map chases a pointer per probe).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace war {

struct Node;

class FlatIndex {
 public:
  Node* find(int32_t key) const {
    for (size_t i = home(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

  // Inserts or replaces.
  void put(int32_t key, Node* value) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t i = home(key);
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    values_[i] = value;
  }

  // Removes `key` if present, shifting later entries of its probe run back so
  // that no tombstones are needed.
  void erase(int32_t key) {
    size_t i = home(key);
    while (keys_[i] != key) {
      if (keys_[i] == kEmpty) return;
      i = (i + 1) & mask_;
    }
    --size_;
    for (size_t j = (i + 1) & mask_;; j = (j + 1) & mask_) {
      if (keys_[j] == kEmpty) break;
      const size_t h = home(keys_[j]);
      // Move entry j into the hole at i unless its home lies cyclically in (i, j].
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        keys_[i] = keys_[j];
        values_[i] = values_[j];
        i = j;
      }
    }
    keys_[i] = kEmpty;
  }

  size_t size() const { return size_; }
  size_t bytes() const { return keys_.capacity() * sizeof(int32_t) + values_.capacity() * sizeof(Node*); }

 private:
  static constexpr int32_t kEmpty = -1;  // token ids are >= 0

  size_t home(int32_t key) const {
    return (static_cast<uint32_t>(key) * 0x9E3779B1u) >> shift_;
  }

  void grow() {
    std::vector<int32_t> keys;
    std::vector<Node*> values;
    keys.swap(keys_);
    values.swap(values_);
    const size_t capacity = keys.empty() ? 32 : keys.size() * 2;
    keys_.assign(capacity, kEmpty);
    values_.assign(capacity, nullptr);
    mask_ = capacity - 1;
    shift_ = 32;
    for (size_t c = capacity; c > 1; c >>= 1) --shift_;
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (keys[i] != kEmpty) put(keys[i], values[i]);
  }

  std::vector<int32_t> keys_;
  std::vector<Node*> values_;
  size_t mask_ = 0;
  int shift_ = 32;
  size_t size_ = 0;
};

}  // namespace war
