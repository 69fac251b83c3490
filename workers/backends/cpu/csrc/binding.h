// The Python binding of one kernel: a module (built by build.py through
// torch.utils.cpp_extension) whose `kernel` is the C++ function, called with its arguments in
// order, each converted after the function's parameter type:
//
//   T*       <- a tensor: its data pointer (read through the function use_data_ptr was given,
//               build.py's tensor_data module: a few ns; before that through Tensor.data_ptr())
//   int64_t  <- an int
//   float, double <- a float (or an int)
//
// METH_FASTCALL and plain CPython: no pybind11 and no torch headers, so a kernel compiles in a
// second or two and a call costs tens of ns. The kernel runs with the GIL held, as inductor's
// bindings ran it. Each kernel file ends with PDSERVE_MODULE(its function).
#pragma once

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <tuple>
#include <utility>

namespace pdserve {

using DataPtr = void* (*)(PyObject*);  // a tensor's data pointer; nullptr with an exception set on error

// Tensor.data_ptr() through Python: what a kernel uses until use_data_ptr gives it better
static inline void* data_ptr_by_method(PyObject* obj) {
  PyObject* address = PyObject_CallMethod(obj, "data_ptr", nullptr);
  if (address == nullptr) return nullptr;
  void* ptr = PyLong_AsVoidPtr(address);
  Py_DECREF(address);
  return ptr;
}

static DataPtr data_ptr = data_ptr_by_method;

template <typename T>
struct Arg;

template <typename T>
struct Arg<T*> {
  static inline bool from(PyObject* obj, T*& out) {
    void* ptr = data_ptr(obj);
    if (ptr == nullptr && PyErr_Occurred()) return false;  // an empty tensor's pointer may be null
    out = static_cast<T*>(ptr);
    return true;
  }
};

template <>
struct Arg<int64_t> {
  static inline bool from(PyObject* obj, int64_t& out) {
    const long long value = PyLong_AsLongLong(obj);
    if (value == -1 && PyErr_Occurred()) return false;
    out = static_cast<int64_t>(value);
    return true;
  }
};

template <>
struct Arg<double> {
  static inline bool from(PyObject* obj, double& out) {
    out = PyFloat_AsDouble(obj);
    return !(out == -1.0 && PyErr_Occurred());
  }
};

template <>
struct Arg<float> {
  static inline bool from(PyObject* obj, float& out) {
    double value;
    if (!Arg<double>::from(obj, value)) return false;
    out = static_cast<float>(value);
    return true;
  }
};

template <auto Kernel>
struct Binding;

template <typename... Args, void (*Kernel)(Args...)>
struct Binding<Kernel> {
  template <std::size_t... I>
  static inline bool convert(PyObject* const* args, std::tuple<Args...>& values, std::index_sequence<I...>) {
    return (Arg<Args>::from(args[I], std::get<I>(values)) && ...);
  }

  static PyObject* call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    if (nargs != static_cast<Py_ssize_t>(sizeof...(Args))) {
      PyErr_Format(PyExc_TypeError, "the kernel takes %zu arguments (%zd given)", sizeof...(Args), nargs);
      return nullptr;
    }
    std::tuple<Args...> values;
    if (!convert(args, values, std::index_sequence_for<Args...>{})) return nullptr;
    try {
      std::apply(Kernel, values);
    } catch (const std::bad_alloc&) {
      return PyErr_NoMemory();
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
    Py_RETURN_NONE;
  }
};

// use_data_ptr(address): read tensors' data pointers through the C function at address
// (void* (PyObject*), build.py passes tensor_data's)
static PyObject* use_data_ptr(PyObject*, PyObject* address) {
  void* fn = PyLong_AsVoidPtr(address);
  if (fn == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "use_data_ptr: a null address");
    return nullptr;
  }
  data_ptr = reinterpret_cast<DataPtr>(fn);
  Py_RETURN_NONE;
}

}  // namespace pdserve

#define PDSERVE_CAT_(a, b) a##b
#define PDSERVE_CAT(a, b) PDSERVE_CAT_(a, b)
#define PDSERVE_STR_(a) #a
#define PDSERVE_STR(a) PDSERVE_STR_(a)

#ifdef Py_GIL_DISABLED
#define PDSERVE_NO_GIL(module) PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED)
#else
#define PDSERVE_NO_GIL(module) ((void)0)
#endif

// The module TORCH_EXTENSION_NAME (build.py's name for this build), with `kernel` calling KERNEL
#define PDSERVE_MODULE(KERNEL)                                                                         \
  static PyMethodDef pdserve_methods[] = {                                                             \
      {"kernel", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&pdserve::Binding<&KERNEL>::call)), \
       METH_FASTCALL, "the kernel (build.py)"},                                                        \
      {"use_data_ptr", pdserve::use_data_ptr, METH_O, "read tensors' data pointers through this C function"}, \
      {nullptr, nullptr, 0, nullptr}};                                                                 \
  static PyModuleDef pdserve_module = {PyModuleDef_HEAD_INIT, PDSERVE_STR(TORCH_EXTENSION_NAME), nullptr, -1, \
                                       pdserve_methods, nullptr, nullptr, nullptr, nullptr};           \
  PyMODINIT_FUNC PDSERVE_CAT(PyInit_, TORCH_EXTENSION_NAME)() {                                        \
    PyObject* module = PyModule_Create(&pdserve_module);                                               \
    if (module != nullptr) PDSERVE_NO_GIL(module);                                                     \
    return module;                                                                                     \
  }
