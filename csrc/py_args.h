// Reading Python arguments in the router's native bindings (prefix_tree_bindings.cc,
// progress_bindings.cc, war_policy_bindings.cc): one place for the checks and messages
// they share.
//
// Knows: how a str becomes the UTF-8 bytes a key is made of (a str with lone
// surrogates as 'surrogatepass' bytes, so that any two different str are different
// keys) and back, how an int argument (or anything Python takes as an index) is
// read within int64, how a number is read as a double (a time: not NaN), and the
// TypeError / ValueError /
// OverflowError each raises, naming the argument; `Text` / `OptText` make a str
// (or None) argument a table key (progress.h's `Key`) for the length of a call.
// Does not know what the values mean. Everything here raises nb::python_error
// with the Python error set.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "progress.h"  // Key, key_of

namespace war::pyargs {

namespace nb = nanobind;

[[noreturn]] inline void raise_type(const char* what, const char* expected, PyObject* got) {
  PyErr_Format(PyExc_TypeError, "%s must be %s, got %s", what, expected, Py_TYPE(got)->tp_name);
  throw nb::python_error();
}

// The UTF-8 bytes of a str argument; `buf` holds them when the str cannot (lone
// surrogates). Valid while the str and `buf` are.
inline std::string_view utf8_of(PyObject* o, const char* what, std::string* buf) {
  if (!PyUnicode_Check(o)) raise_type(what, "a str", o);
  Py_ssize_t n = 0;
  const char* p = PyUnicode_AsUTF8AndSize(o, &n);
  if (p != nullptr) return std::string_view(p, static_cast<size_t>(n));
  if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) throw nb::python_error();
  PyErr_Clear();
  PyObject* b = PyUnicode_AsEncodedString(o, "utf-8", "surrogatepass");
  if (b == nullptr) throw nb::python_error();
  buf->assign(PyBytes_AS_STRING(b), static_cast<size_t>(PyBytes_GET_SIZE(b)));
  Py_DECREF(b);
  return *buf;
}

// The str of bytes made by utf8_of.
inline nb::object str_of(std::string_view bytes) {
  PyObject* s = PyUnicode_DecodeUTF8(bytes.data(), static_cast<Py_ssize_t>(bytes.size()),
                                     "surrogatepass");
  if (s == nullptr) throw nb::python_error();
  return nb::steal(s);
}

// An int argument (or anything Python accepts as an index) within int64.
inline int64_t int_of(PyObject* o, const char* what) {
  PyObject* idx;
  if (PyLong_Check(o)) {
    idx = o;
    Py_INCREF(idx);
  } else {
    idx = PyNumber_Index(o);
    if (idx == nullptr) {
      if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
      PyErr_Clear();
      raise_type(what, "an int", o);
    }
  }
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(idx, &overflow);
  Py_DECREF(idx);
  if (overflow != 0) {
    PyErr_Format(PyExc_OverflowError, "%s does not fit in int64", what);
    throw nb::python_error();
  }
  if (v == -1 && PyErr_Occurred()) throw nb::python_error();
  return static_cast<int64_t>(v);
}

// A number argument as a double (ints and anything with __float__).
inline double float_of(PyObject* o, const char* what) {
  if (PyFloat_CheckExact(o)) return PyFloat_AS_DOUBLE(o);
  const double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred()) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw nb::python_error();
    PyErr_Clear();
    raise_type(what, "a number", o);
  }
  return v;
}

// A `now` argument: a number, not NaN (ValueError).
inline double time_of(PyObject* o) {
  const double v = float_of(o, "now");
  if (v != v) {
    PyErr_SetString(PyExc_ValueError, "now must not be NaN");
    throw nb::python_error();
  }
  return v;
}

// A str argument's key, valid for the call.
class Text {
 public:
  Text(PyObject* o, const char* what) : key(war::progress::key_of(utf8_of(o, what, &buf_))) {}
  Text(const Text&) = delete;
  Text& operator=(const Text&) = delete;

 private:
  std::string buf_;  // (before `key`, which is made from it)

 public:
  war::progress::Key key;
};

// A str or None argument.
class OptText {
 public:
  OptText(PyObject* o, const char* what) {
    if (o != Py_None) text_.emplace(o, what);
  }
  const war::progress::Key* get() const { return text_ ? &text_->key : nullptr; }

 private:
  std::optional<Text> text_;
};

}  // namespace war::pyargs
