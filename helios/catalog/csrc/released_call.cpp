// A compiled program's call that lets other Python threads run (helios/catalog/released.py).
//
// torch's Python binding of AOTIModelPackageLoader::boxed_run lets the GIL go,
// but the package frees each input tensor after its last use, and freeing the
// last C++ reference to a tensor Python owns takes the GIL to hand the tensor
// back to its Python object: about 40 times per decode step, each a wait while
// the control thread or the event loop runs Python. ``flare_boxed_run`` is
// called through ctypes.PyDLL, so it starts and ends holding the GIL: it wraps
// the inputs in TensorImpls Python does not own (``unowned``), releases the GIL
// for the package's run, in which nothing then touches Python, and takes it
// back to hand the outputs to Python.

#include <pybind11/conduit/pybind11_conduit_v1.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <exception>
#include <string>
#include <typeinfo>
#include <vector>

using torch::inductor::AOTIModelPackageLoader;

namespace {

// torch registers the Python class as its own subclass of the loader,
// torch::inductor::AOTIModelPackageLoaderPybind (torch/csrc/inductor/aoti_package/pybind.cpp),
// which adds Python-facing methods and no state; its type_info is not exported.
// pybind11 finds a registered type by its type_info's name, so the conduit is
// asked for that name; the object it returns is the loader at offset zero.
struct NamedType : std::type_info {
  explicit NamedType(const char* name) : std::type_info(name) {}
};
const NamedType kPythonLoader("N5torch8inductor28AOTIModelPackageLoaderPybindE");

// The same tensor (storage, sizes, strides, version counter) under a TensorImpl that Python does
// not own. The package drops each input as soon as it is last used; dropping the last C++ reference
// to a tensor Python owns hands it back to its Python object, which takes the GIL (and a view made
// by ``alias()`` holds its base, so it does the same when it dies).
at::Tensor unowned(const at::Tensor& tensor) {
  const auto* impl = tensor.unsafeGetTensorImpl();
  return at::Tensor(impl->shallow_copy_and_detach(impl->version_counter(), impl->allow_tensor_metadata_change()));
}

}  // namespace

extern "C" {

// The C++ loader behind ``loader`` (a torch._C._aoti.AOTIModelPackageLoader); null
// with a Python error set when the object is not one this build can read. The
// pointer lives as long as the Python object.
void* flare_loader_pointer(PyObject* loader) {
  void* found = pybind11_conduit_v1::get_raw_pointer_ephemeral(loader, &kPythonLoader);
  if (found == nullptr && !PyErr_Occurred()) {
    PyErr_SetString(PyExc_TypeError, "not a torch AOTInductor package loader this build can read");
  }
  return found;
}

// The package's outputs (a tuple of tensors) for ``inputs`` (a list of tensors),
// run without the GIL; null with a Python error set when an input is not a
// tensor or the package throws.
PyObject* flare_boxed_run(void* loader, PyObject* inputs) {
  if (!PyList_Check(inputs)) {
    PyErr_SetString(PyExc_TypeError, "flare_boxed_run takes a list of tensors");
    return nullptr;
  }
  const Py_ssize_t count = PyList_GET_SIZE(inputs);
  std::vector<at::Tensor> taken;
  taken.reserve(static_cast<size_t>(count));
  for (Py_ssize_t i = 0; i < count; ++i) {
    PyObject* item = PyList_GET_ITEM(inputs, i);
    if (!THPVariable_Check(item)) {
      PyErr_Format(PyExc_TypeError, "input %zd of a compiled program is not a tensor", i);
      return nullptr;
    }
    taken.push_back(unowned(THPVariable_Unpack(item)));
  }
  std::vector<at::Tensor> outputs;
  std::string error;
  Py_BEGIN_ALLOW_THREADS
  try {
    outputs = static_cast<AOTIModelPackageLoader*>(loader)->boxed_run(std::move(taken));
  } catch (const std::exception& exc) {
    error = exc.what();
    if (error.empty()) {
      error = "the compiled program failed";
    }
  }
  Py_END_ALLOW_THREADS
  if (!error.empty()) {
    PyErr_SetString(PyExc_RuntimeError, error.c_str());
    return nullptr;
  }
  PyObject* result = PyTuple_New(static_cast<Py_ssize_t>(outputs.size()));
  if (result == nullptr) {
    return nullptr;
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    PyObject* wrapped = THPVariable_Wrap(std::move(outputs[i]));
    if (wrapped == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyTuple_SET_ITEM(result, static_cast<Py_ssize_t>(i), wrapped);
  }
  return result;
}

}  // extern "C"
