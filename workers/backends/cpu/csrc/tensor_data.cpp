// A tensor's data pointer from its Python object, for the kernels' bindings (binding.h): the one
// module that includes torch's Python headers (a slow compile, once per torch version and cache
// directory), so that no kernel does. `address()` gives the C function's address; build.py hands
// it to each kernel module (use_data_ptr). Through the public extension API (THPVariable_Check,
// THPVariable_Unpack): a call costs a few ns, where Tensor.data_ptr() through Python costs tens.
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <exception>

// obj's data pointer (null for an empty tensor), or nullptr with a Python exception set
static void* tensor_data(PyObject* obj) noexcept {
  if (!THPVariable_Check(obj)) {
    PyErr_Format(PyExc_TypeError, "a kernel argument must be a tensor, not %s", Py_TYPE(obj)->tp_name);
    return nullptr;
  }
  try {
    return THPVariable_Unpack(obj).data_ptr();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

static PyObject* address(PyObject*, PyObject*) {
  return PyLong_FromVoidPtr(reinterpret_cast<void*>(&tensor_data));
}

static PyMethodDef methods[] = {
    {"address", address, METH_NOARGS, "the address of void* tensor_data(PyObject*)"},
    {nullptr, nullptr, 0, nullptr}};

#define PDSERVE_CAT_(a, b) a##b
#define PDSERVE_CAT(a, b) PDSERVE_CAT_(a, b)
#define PDSERVE_STR_(a) #a
#define PDSERVE_STR(a) PDSERVE_STR_(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, PDSERVE_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods,
                                 nullptr, nullptr, nullptr, nullptr};

PyMODINIT_FUNC PDSERVE_CAT(PyInit_, TORCH_EXTENSION_NAME)() {
  return PyModule_Create(&module_def);
}
