// Per-tensor checks of the fast tier in one C++ pass (built on first use by native.py).
//
// A guard on each of 200 parameters and their gradients costs ~100 ns per tensor through
// dynamo's guard tree or Python; here a whole list costs a few ns per tensor:
//
//   plain(types)                            types whose .grad is TensorBase's own (set once)
//   spec(values, ids[, ptrs[, dts]])        record each value's metadata (None or a tensor),
//       -> capsule                          with ids=True its identity, with ptrs=True its
//                                           data pointer (checked in the same visit); dts
//                                           (a list, per value None or a DTensor's
//                                           (mesh | None, placements | None, ptr: bool)):
//                                           that DTensor's ._local_tensor is recorded too
//                                           (its metadata; with ids its identity; with ptr
//                                           its data pointer) and its spec's mesh and
//                                           placements (each compared with ==)
//   match(spec, grad, container) -> bool    container[i] (or container[i].grad) still matches
//   match_both(grads, items, container)     match(grads, True, ...) and match(items, False,
//                                           ...) in one visit of each item
//   grads(objects) -> list                  [o.grad for o in objects]
//   count_grads(objects) -> int             how many of objects have a grad (no Python
//                                           object made for a plain tensor's grad)
//   clear_grads(objects)                    o.grad = None for o in objects (what the setter
//                                           does, without a Python setattr per object)
//   take(spec) -> list | None               the grads the last passing match(spec, True,
//                                           ...) read, once (None if taken or it failed)
//   take_locals(spec) -> list | None        the ._local_tensor of each DTensor the last
//                                           passing match of spec read (None where a value
//                                           had no dts entry), once
//   by_address(spec) -> bool                from now on a passing match(spec, True, ...)
//                                           keeps the grads' data pointers, not the grads
//                                           (no take(); False for a spec with DTensors)
//   addresses(indices, checked[, links])    positions in an input list (-1: none) whose
//       -> capsule                          data pointers are recorded, some compared;
//                                           links (per position None or (spec, item)):
//                                           where the list holds None there, the pointer
//                                           is the one the last passing match of that
//                                           by_address spec read from item's grad
//   addresses_record(addresses, tensors)    record tensors[i].data_ptr() for each position
//                                           (0 for -1) and return them as a list
//   addresses_equal(addresses, tensors)     the checked positions keep what was recorded
//   held(tensors, ptrs) -> capsule          hold tensors (strong references), their
//                                           expected data pointers (None: not checked)
//                                           and their metadata now (as TensorMatchGuard)
//   held_match(held, _) -> bool             each held tensor still has its data pointer
//                                           and metadata (t_(), as_strided_(), .data =
//                                           and requires_grad_() change those in place)
//   versions(d) -> capsule                  d's dict version tag and each of its values'
//                                           (dicts); only where CPython has the tags (<3.14)
//   versions_match(spec, d) -> bool         d and each of its values keep their tags
//   dict_version(d) -> int                  d's own version tag (the same int: no entry of
//                                           d set, added or removed since); not a dict: a
//                                           new object, equal to no other
//   h2d(dst, src, nbytes, stream, device)   queue a host-to-device copy through the CUDA
//       -> bool                             driver (False: not queued; see below)
//
// "Matches" is TensorMatchGuard's test (guards.py): same Python type, dtype, device,
// layout, shape, stride and requires_grad; an entry recorded as None must still be None.

#include <Python.h>
#include <structmember.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include <dlfcn.h>

// torch >= 2.13 keeps a tensor's Python object in one slot read with load_pyobj(): a grad's
// Python type is then read without wrapping it (older torch: THPVariable_Wrap and release).
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#endif
#if defined(TORCH_VERSION_MAJOR) && defined(TORCH_VERSION_MINOR) && \
    (TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 13))
#define OPT_LOAD_PYOBJ 1
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

// ma_version_tag (PEP 509): deprecated in 3.12, gone in 3.14. A dict's tag changes whenever
// one of its entries is set, added or removed, and is unique across dicts (a global
// counter), as dynamo's DICT_VERSION guard relies on too.
#if PY_VERSION_HEX < 0x030E0000
#define OPT_DICT_VERSIONS 1
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif

namespace {

constexpr int64_t kInline = 4;

struct DTMeta;

struct Meta {
  Py_ssize_t index;  // position in the container
  PyObject* id;      // the very object expected (not owned; compared by address), or null
  bool none;         // the value was None
  PyTypeObject* type;
  c10::ScalarType dtype;
  c10::Device device{c10::kCPU};
  c10::Layout layout;
  bool requires_grad;
  bool check_ptr;   // the data pointer must stay ``ptr``
  const void* ptr;
  // Sizes then strides: inline up to kInline dimensions (no pointer to chase per tensor).
  int64_t dim = 0;
  int64_t inline_dims[2 * kInline] = {};
  std::vector<int64_t> dims;  // more than kInline dimensions
  // A DTensor's: its local tensor's metadata, its spec's mesh and placements (or null).
  std::shared_ptr<DTMeta> dt;

  void set_dims(c10::IntArrayRef sizes, c10::IntArrayRef strides) {
    dim = static_cast<int64_t>(sizes.size());
    int64_t* out = inline_dims;
    if (dim > kInline) {
      dims.resize(2 * dim);
      out = dims.data();
    }
    std::copy(sizes.begin(), sizes.end(), out);
    std::copy(strides.begin(), strides.end(), out + dim);
  }

  bool same_dims(const at::Tensor& t) const {
    if (t.dim() != dim) return false;
    const int64_t* expected = dim > kInline ? dims.data() : inline_dims;
    c10::IntArrayRef sizes = t.sizes();
    c10::IntArrayRef strides = t.strides();
    for (int64_t d = 0; d < dim; ++d)
      if (sizes[d] != expected[d] || strides[d] != expected[dim + d]) return false;
    return true;
  }
};

// What a DTensor value's spec (``._spec.mesh``, ``._spec.placements``: the getters of its
// ``device_mesh`` and ``placements``) and its ``._local_tensor`` must keep.
struct DTMeta {
  // Where the DTensor type keeps ``_spec`` and ``_local_tensor`` (slots: member
  // descriptors), read straight from the object while the type's version tag is the one
  // recorded (nothing reassigned on the class); else (or -1) through getattr.
  PyTypeObject* owner = nullptr;  // not owned: the Meta's type (held by it)
  unsigned int tag = 0;
  Py_ssize_t spec_offset = -1;
  Py_ssize_t local_offset = -1;
  PyObject* mesh = nullptr;        // owned; null: not checked
  PyObject* placements = nullptr;  // owned; null: not checked
  PyObject* local_id = nullptr;    // owned: the very local tensor expected, or null
  Meta local;                      // its local tensor's metadata (a plain tensor)
  ~DTMeta() {
    Py_XDECREF(mesh);
    Py_XDECREF(placements);
    Py_XDECREF(local_id);
    Py_XDECREF(reinterpret_cast<PyObject*>(local.type));
  }
};

struct Spec {
  std::vector<Meta> metas;
  bool has_dt = false;         // some meta has a DTMeta: a passing match stashes the locals
  PyObject* locals = nullptr;  // owned: the local tensors the last passing match read
  // After a passing match of the items' .grad: the grads it read, in item order (owned), for
  // the caller's gather to take instead of reading them again (see take()).
  PyObject* stash = nullptr;
  // by_address(): a passing grad match keeps the grads' data pointers instead (in item
  // order; valid until the next match of this spec begins), for linked Addresses.
  bool by_address = false;
  bool ptrs_valid = false;
  std::vector<const void*> ptrs;
  ~Spec() {
    for (Meta& m : metas) Py_XDECREF(reinterpret_cast<PyObject*>(m.type));
    Py_XDECREF(stash);
    Py_XDECREF(locals);
  }
};

// Types whose .grad is TensorBase's own getter (torch.Tensor, torch.nn.Parameter): their
// gradient is read in C++; any other type through getattr. Owned references, set by plain().
std::vector<PyObject*> g_plain;

const char* kCapsule = "optguard.native.Spec";

void drop_spec(PyObject* capsule) {
  delete static_cast<Spec*>(PyCapsule_GetPointer(capsule, kCapsule));
}

bool is_plain(PyObject* obj) {
  for (PyObject* t : g_plain)
    if (reinterpret_cast<PyObject*>(Py_TYPE(obj)) == t) return true;
  return false;
}

// obj.grad as a new reference (nullptr with an error set on failure).
PyObject* grad_of(PyObject* obj) {
  if (is_plain(obj)) return THPVariable_Wrap(THPVariable_Unpack(obj).grad());
  return PyObject_GetAttrString(obj, "grad");
}

PyObject* plain(PyObject*, PyObject* types) {
  if (!PyTuple_Check(types)) {
    PyErr_SetString(PyExc_TypeError, "plain(types: tuple)");
    return nullptr;
  }
  for (PyObject* t : g_plain) Py_DECREF(t);
  g_plain.clear();
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(types); ++i) {
    PyObject* t = PyTuple_GET_ITEM(types, i);
    Py_INCREF(t);
    g_plain.push_back(t);
  }
  Py_RETURN_NONE;
}

bool matches_tensor(const Meta& m, const at::Tensor& t) {
  if (t.scalar_type() != m.dtype || t.device() != m.device || t.layout() != m.layout ||
      !m.same_dims(t) || t.requires_grad() != m.requires_grad)
    return false;
  return !m.check_ptr || t.const_data_ptr() == m.ptr;
}

bool matches(const Meta& m, PyObject* value) {
  if (m.id != nullptr && value != m.id) return false;
  if (m.none) return value == Py_None;
  // m.type is a tensor type (spec checked it): the same type means a THPVariable.
  if (Py_TYPE(value) != m.type) return false;
  return matches_tensor(m, THPVariable_Unpack(value));
}

// A plain item's grad checked as a C++ tensor (its Python type is checked once wrapped).
bool grad_matches(const Meta& m, const at::Tensor& grad) {
  if (m.none) return !grad.defined();
  return grad.defined() && matches_tensor(m, grad);
}

// Interned attribute names of a DTensor (torch.distributed.tensor): set at import.
PyObject* g_local_tensor = nullptr;  // "_local_tensor"
PyObject* g_spec = nullptr;          // "_spec"
PyObject* g_mesh = nullptr;          // "mesh"
PyObject* g_placements = nullptr;    // "placements"

// Record a strided tensor's metadata into m (with ptr, its data pointer checked too); throws
// for a tensor without plain sizes (a nested one).
void fill_tensor_meta(Meta& m, const at::Tensor& t, bool ptr) {
  m.set_dims(t.sizes(), t.strides());
  if (ptr) {
    m.check_ptr = true;
    m.ptr = t.const_data_ptr();
  }
  m.dtype = t.scalar_type();
  m.device = t.device();
  m.layout = t.layout();
  m.requires_grad = t.requires_grad();
}

// Record v's metadata into m (v: None or a strided tensor); false with an error set.
bool fill_meta(Meta& m, PyObject* v, Py_ssize_t i, bool id, bool ptr) {
  m.index = i;
  m.id = id ? v : nullptr;
  m.none = v == Py_None;
  m.type = nullptr;
  m.dtype = c10::ScalarType::Undefined;
  m.layout = c10::kStrided;
  m.requires_grad = false;
  m.check_ptr = false;
  m.ptr = nullptr;
  if (m.none) return true;
  if (!THPVariable_Check(v)) {
    PyErr_Format(PyExc_TypeError, "spec: item %zd is neither a tensor nor None", i);
    return false;
  }
  const at::Tensor& t = THPVariable_Unpack(v);
  if (t.layout() != c10::kStrided) {
    PyErr_Format(PyExc_ValueError, "spec: item %zd is not a strided tensor", i);
    return false;
  }
  try {
    fill_tensor_meta(m, t, ptr);
  } catch (const std::exception& e) {  // a nested tensor: no plain sizes
    PyErr_Format(PyExc_ValueError, "spec: item %zd: %s", i, e.what());
    return false;
  }
  m.type = Py_TYPE(v);
  Py_INCREF(reinterpret_cast<PyObject*>(m.type));
  return true;
}

// The offset of a slot ``name`` of type (a member descriptor holding an object), or -1.
Py_ssize_t slot_offset(PyTypeObject* type, PyObject* name) {
  PyObject* descr = _PyType_Lookup(type, name);  // borrowed
  if (descr == nullptr || Py_TYPE(descr) != &PyMemberDescr_Type) return -1;
  PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member;
  if (member->type != T_OBJECT_EX || (member->flags & READONLY)) return -1;
  return member->offset;
}

// obj.<name> as a new reference (nullptr, no error set, when it fails): from its slot when
// d's offsets hold for obj's type, else through getattr.
PyObject* dt_attr(const DTMeta& d, PyObject* obj, Py_ssize_t offset, PyObject* name) {
  PyTypeObject* type = Py_TYPE(obj);
  if (offset >= 0 && type == d.owner && type->tp_version_tag == d.tag &&
      PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
    PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + offset);
    Py_XINCREF(v);
    return v;  // (null: the slot is empty, as getattr's AttributeError)
  }
  PyObject* v = PyObject_GetAttr(obj, name);
  if (v == nullptr) PyErr_Clear();
  return v;
}

// Record DTensor v's local tensor and expected mesh and placements (entry: a tuple
// (mesh | None, placements | None, ptr: bool)); false with an error set.
bool fill_dt(Meta& m, PyObject* v, PyObject* entry, bool id) {
  if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
    PyErr_SetString(PyExc_TypeError, "spec: dts entry is not (mesh, placements, ptr)");
    return false;
  }
  auto dt = std::make_shared<DTMeta>();
  PyTypeObject* type = Py_TYPE(v);
  if (_PyType_Lookup(type, g_spec) != nullptr &&
      PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG)) {
    dt->owner = type;
    dt->tag = type->tp_version_tag;
    dt->spec_offset = slot_offset(type, g_spec);
    dt->local_offset = slot_offset(type, g_local_tensor);
  }
  PyObject* local = PyObject_GetAttr(v, g_local_tensor);
  if (local == nullptr) return false;
  bool ok = fill_meta(dt->local, local, m.index, false, PyTuple_GET_ITEM(entry, 2) == Py_True);
  if (ok && dt->local.none) {
    PyErr_SetString(PyExc_ValueError, "spec: a DTensor without a local tensor");
    ok = false;
  }
  if (!ok) {
    Py_DECREF(local);
    return false;
  }
  if (id) {
    dt->local_id = local;  // the reference is DTMeta's now
  } else {
    Py_DECREF(local);
  }
  PyObject* mesh = PyTuple_GET_ITEM(entry, 0);
  PyObject* placements = PyTuple_GET_ITEM(entry, 1);
  if (mesh != Py_None) {
    Py_INCREF(mesh);
    dt->mesh = mesh;
  }
  if (placements != Py_None) {
    Py_INCREF(placements);
    dt->placements = placements;
  }
  m.dt = std::move(dt);
  return true;
}

PyObject* spec(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 4 || !PyList_Check(args[0]) ||
      (nargs == 4 && args[3] != Py_None &&
       (!PyList_Check(args[3]) || PyList_GET_SIZE(args[3]) != PyList_GET_SIZE(args[0])))) {
    PyErr_SetString(PyExc_TypeError,
                    "spec(values: list, ids: bool, ptrs: bool = False, dts: list | None)");
    return nullptr;
  }
  PyObject* values = args[0];
  bool ids = args[1] == Py_True;
  bool ptrs = nargs >= 3 && args[2] == Py_True;
  PyObject* dts = nargs == 4 && args[3] != Py_None ? args[3] : nullptr;
  auto* out = new Spec();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values); ++i) {
    PyObject* v = PyList_GET_ITEM(values, i);
    PyObject* entry = dts != nullptr ? PyList_GET_ITEM(dts, i) : Py_None;
    Meta m;
    bool dtensor = entry != Py_None && v != Py_None;
    // A DTensor's data pointer is its local tensor's (the DTensor itself has no storage).
    if (!fill_meta(m, v, i, ids, ptrs && !dtensor) || (dtensor && !fill_dt(m, v, entry, ids))) {
      Py_XDECREF(reinterpret_cast<PyObject*>(m.type));
      delete out;
      return nullptr;
    }
    out->has_dt = out->has_dt || dtensor;
    out->metas.push_back(std::move(m));
  }
  return PyCapsule_New(out, kCapsule, drop_spec);
}

// value's spec keeps the expected mesh and placements (==, as the generated check compares
// ``value.device_mesh`` and ``value.placements``), its ._local_tensor matches d.local; the
// local tensor (a new reference) into *local. Any error reading them is a miss.
bool dt_matches(const DTMeta& d, PyObject* value, PyObject** local) {
  *local = nullptr;
  if (d.mesh != nullptr || d.placements != nullptr) {
    PyObject* spec = dt_attr(d, value, d.spec_offset, g_spec);
    if (spec == nullptr) return false;
    for (int k = 0; k < 2; ++k) {
      PyObject* expected = k == 0 ? d.mesh : d.placements;
      if (expected == nullptr) continue;
      PyObject* now = PyObject_GetAttr(spec, k == 0 ? g_mesh : g_placements);
      int same = now == nullptr ? -1 : (now == expected ? 1 : PyObject_RichCompareBool(now, expected, Py_EQ));
      Py_XDECREF(now);
      if (same != 1) {
        if (same < 0) PyErr_Clear();
        Py_DECREF(spec);
        return false;
      }
    }
    Py_DECREF(spec);
  }
  PyObject* t = dt_attr(d, value, d.local_offset, g_local_tensor);
  if (t == nullptr) return false;
  if ((d.local_id != nullptr && t != d.local_id) || Py_TYPE(t) != d.local.type ||
      !matches_tensor(d.local, THPVariable_Unpack(t))) {
    Py_DECREF(t);
    return false;
  }
  *local = t;
  return true;
}

// A DTensor's spec and local tensor (put into locals[m.index]), for a value that matches m.
bool dt_part(const Meta& m, PyObject* value, PyObject* locals) {
  if (!m.dt || m.none) return true;
  PyObject* local;
  if (!dt_matches(*m.dt, value, &local)) return false;
  PyList_SET_ITEM(locals, m.index, local);  // (its slot was empty: the list owns it)
  return true;
}

// matches(m, value), then a DTensor's spec and local tensor (put into locals[m.index]).
bool matches_dt(const Meta& m, PyObject* value, PyObject* locals) {
  return matches(m, value) && dt_part(m, value, locals);
}

// A new list of n empty slots for the local tensors a match reads (nullptr: none needed).
PyObject* new_locals(const Spec* s, Py_ssize_t n, bool* failed) {
  *failed = false;
  if (s == nullptr || !s->has_dt) return nullptr;
  PyObject* out = PyList_New(n);
  *failed = out == nullptr;
  return out;
}

void keep_locals(Spec* s, PyObject* locals) {
  if (locals == nullptr) return;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(locals); ++i) {
    if (PyList_GET_ITEM(locals, i) == nullptr) {
      Py_INCREF(Py_None);
      PyList_SET_ITEM(locals, i, Py_None);
    }
  }
  Py_XDECREF(s->locals);
  s->locals = locals;
}

// container[i] (or its .grad, with grad) matches s's entry i for every i; with items, each
// container[i] itself also matches items' entry i, in the same visit. A passing grad match
// stashes the grads it read (see take()); a passing match of DTensors the local tensors it
// read (see take_locals()).
PyObject* match_list(Spec* s, bool grad, Spec* items, PyObject* container) {
  Py_CLEAR(s->stash);
  Py_CLEAR(s->locals);
  s->ptrs_valid = false;
  if (items != nullptr) Py_CLEAR(items->locals);
  if (!PyList_Check(container)) Py_RETURN_FALSE;
  Py_ssize_t n = PyList_GET_SIZE(container);
  if (n != static_cast<Py_ssize_t>(s->metas.size())) Py_RETURN_FALSE;
  // The grads, in item order; by address: their data pointers instead.
  const bool by_address = grad && s->by_address;
  PyObject* read = nullptr;
  if (grad && !by_address && (read = PyList_New(n)) == nullptr) return nullptr;
  if (by_address) s->ptrs.assign(static_cast<size_t>(n), nullptr);
  bool failed;
  PyObject* locals = new_locals(s, n, &failed);  // the local tensors of s's DTensors
  if (failed) {
    Py_XDECREF(read);
    return nullptr;
  }
  PyObject* item_locals = new_locals(items, n, &failed);  // and of items'
  if (failed) {
    Py_XDECREF(read);
    Py_XDECREF(locals);
    return nullptr;
  }
  bool ok = true;
  try {
    const size_t count = s->metas.size();
    for (size_t i = 0; ok && i < count; ++i) {
      const Meta& m = s->metas[i];
      // (memory ahead, as in held_match: the item's Python object, then its impl)
      if (i + 8 < count) __builtin_prefetch(PyList_GET_ITEM(container, s->metas[i + 8].index));
      if (i + 4 < count) {
        const Meta& am = s->metas[i + 4];
        PyObject* ahead = PyList_GET_ITEM(container, am.index);
        // (a tensor by its exact type: THPVariable_Check of a subclass, a DTensor, is an
        // isinstance through its metaclass, ~40 ns)
        if ((am.type != nullptr && Py_TYPE(ahead) == am.type) || is_plain(ahead))
          __builtin_prefetch(THPVariable_Unpack(ahead).unsafeGetTensorImpl());
      }
      PyObject* item = PyList_GET_ITEM(container, m.index);
      if (!grad) {
        ok = matches_dt(m, item, locals);
        continue;
      }
      if (items != nullptr && !matches_dt(items->metas[m.index], item, item_locals)) {
        ok = false;
        continue;
      }
      if (is_plain(item)) {  // the grad checked in C++ first, then wrapped for the stash
        // (the impl's own: TensorBase::grad() also asks autograd, out of line, whether the
        // item is a leaf, only to warn when a non-leaf's undefined grad is read)
        const at::Tensor& gt = THPVariable_Unpack(item).unsafeGetTensorImpl()->grad();
        if (!grad_matches(m, gt)) {
          ok = false;
          continue;
        }
#ifdef OPT_LOAD_PYOBJ
        if (by_address && !m.dt) {  // its Python type, without a reference to it
          if (m.none) continue;
          PyObject* obj = gt.unsafeGetTensorImpl()->pyobj_slot()->load_pyobj();
          // (none yet: wrapping would make a plain torch.Tensor)
          auto* type = obj != nullptr ? Py_TYPE(obj)
                                      : reinterpret_cast<PyTypeObject*>(THPVariableClass);
          ok = type == m.type;
          s->ptrs[m.index] = gt.const_data_ptr();
          continue;
        }
#endif
        PyObject* g = THPVariable_Wrap(gt);  // its Python object (made if it has none)
        if (g == nullptr) {
          PyErr_Clear();
          ok = false;
          continue;
        }
        ok = m.none || (Py_TYPE(g) == m.type && dt_part(m, g, locals));
        if (by_address) {
          if (ok && !m.none) s->ptrs[m.index] = gt.const_data_ptr();
          Py_DECREF(g);
        } else {
          PyList_SET_ITEM(read, m.index, g);  // the list owns it from here
        }
        continue;
      }
      PyObject* g = grad_of(item);
      if (g == nullptr) {
        PyErr_Clear();  // any error fetching is a miss, as in the generated check
        ok = false;
        continue;
      }
      ok = matches_dt(m, g, locals);
      if (by_address) {
        if (ok && g != Py_None) s->ptrs[m.index] = THPVariable_Unpack(g).const_data_ptr();
        Py_DECREF(g);
      } else {
        PyList_SET_ITEM(read, m.index, g);  // the list owns it from here
      }
    }
  } catch (const std::exception&) {  // metadata torch cannot give (a nested tensor's sizes)
    ok = false;
  }
  if (!ok) {
    Py_XDECREF(read);
    Py_XDECREF(locals);
    Py_XDECREF(item_locals);
    Py_RETURN_FALSE;
  }
  s->stash = read;
  s->ptrs_valid = by_address;
  keep_locals(s, locals);
  if (items != nullptr) keep_locals(items, item_locals);
  Py_RETURN_TRUE;
}

PyObject* match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "match(spec, grad: bool, container: list)");
    return nullptr;
  }
  auto* s = static_cast<Spec*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (s == nullptr) return nullptr;
  return match_list(s, args[1] == Py_True, nullptr, args[2]);
}

PyObject* match_both(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "match_both(grads_spec, items_spec, container: list)");
    return nullptr;
  }
  auto* s = static_cast<Spec*>(PyCapsule_GetPointer(args[0], kCapsule));
  if (s == nullptr) return nullptr;
  auto* items = static_cast<Spec*>(PyCapsule_GetPointer(args[1], kCapsule));
  if (items == nullptr) return nullptr;
  if (items->metas.size() != s->metas.size()) {
    PyErr_SetString(PyExc_ValueError, "match_both: specs of different lengths");
    return nullptr;
  }
  return match_list(s, true, items, args[2]);
}

// What a spec's last match left in ``field`` (None if nothing): the caller's reference now.
PyObject* take_field(PyObject* capsule, PyObject* Spec::*field) {
  auto* s = static_cast<Spec*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (s == nullptr) return nullptr;
  if (s->*field == nullptr) Py_RETURN_NONE;
  PyObject* out = s->*field;
  s->*field = nullptr;
  return out;
}

PyObject* take(PyObject*, PyObject* capsule) { return take_field(capsule, &Spec::stash); }

PyObject* take_locals(PyObject*, PyObject* capsule) {
  return take_field(capsule, &Spec::locals);
}

PyObject* by_address(PyObject*, PyObject* capsule) {
  auto* s = static_cast<Spec*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (s == nullptr) return nullptr;
  if (s->has_dt) Py_RETURN_FALSE;  // (its gather takes the DTensors' local tensors)
  s->by_address = true;
  Py_CLEAR(s->stash);
  Py_RETURN_TRUE;
}

PyObject* grads(PyObject*, PyObject* objects) {
  if (!PyList_Check(objects)) {
    PyErr_SetString(PyExc_TypeError, "grads(objects: list)");
    return nullptr;
  }
  Py_ssize_t n = PyList_GET_SIZE(objects);
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* g = grad_of(PyList_GET_ITEM(objects, i));
    if (g == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, g);
  }
  return out;
}

// How many objects have a grad. A plain tensor's is read in C++: grads(), and reading
// .grad in Python, give a grad made in C++ (by autograd) a Python object, which then lives
// as long as the grad and is freed with it.
PyObject* count_grads(PyObject*, PyObject* objects) {
  if (!PyList_Check(objects)) {
    PyErr_SetString(PyExc_TypeError, "count_grads(objects: list)");
    return nullptr;
  }
  Py_ssize_t count = 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); ++i) {
    PyObject* obj = PyList_GET_ITEM(objects, i);
    if (is_plain(obj)) {
      count += THPVariable_Unpack(obj).grad().defined() ? 1 : 0;
      continue;
    }
    PyObject* g = PyObject_GetAttrString(obj, "grad");
    if (g == nullptr) return nullptr;
    count += g != Py_None ? 1 : 0;
    Py_DECREF(g);
  }
  return PyLong_FromSsize_t(count);
}

// Each object's .grad set to None. A plain tensor's setter (THPVariable_set_grad) resets
// the grad in C++ unless a torch function mode is on (the mode then sees the assignment, as
// any other type's setter does here through setattr). Freeing a grad may run Python (its
// object's finalizers): the list is read by index, its length each time.
PyObject* clear_grads(PyObject*, PyObject* objects) {
  if (!PyList_Check(objects)) {
    PyErr_SetString(PyExc_TypeError, "clear_grads(objects: list)");
    return nullptr;
  }
  bool direct = !at::impl::torch_function_mode_enabled();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objects); ++i) {
    PyObject* obj = PyList_GET_ITEM(objects, i);
    Py_INCREF(obj);
    int failed = 0;
    if (direct && is_plain(obj)) {
      try {
        THPVariable_Unpack(obj).mutable_grad().reset();
      } catch (const std::exception& e) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        failed = -1;
      }
    } else {
      failed = PyObject_SetAttrString(obj, "grad", Py_None);
    }
    Py_DECREF(obj);
    if (failed < 0) return nullptr;
  }
  Py_RETURN_NONE;
}

// -- addresses of inputs at fixed positions: recorded once, compared each call ----------

bool is_tensor(PyObject* obj) { return is_plain(obj) || THPVariable_Check(obj); }

struct Addresses {
  std::vector<Py_ssize_t> indices;  // positions in the inputs; -1: a slot with no input (0)
  std::vector<bool> checked;         // compared by addresses_equal
  std::vector<const void*> ptrs;     // recorded by addresses_record
  bool recorded = false;
  // Per position, a by_address spec (or null) and the item whose grad's pointer it read:
  // used where the inputs hold None at that position. The specs' capsules are owned.
  std::vector<Spec*> link_spec;
  std::vector<Py_ssize_t> link_item;
  std::vector<PyObject*> owned;
  ~Addresses() {
    for (PyObject* o : owned) Py_DECREF(o);
  }
};

// The data pointer of the input at position k of a (an input tensor's, or where the input
// list holds None there, its linked spec's): false when there is none to give.
bool address_of(const Addresses* a, size_t k, PyObject* t, const void** out) {
  if (t == Py_None && a->link_spec[k] != nullptr) {
    const Spec* s = a->link_spec[k];
    if (!s->ptrs_valid) return false;
    *out = s->ptrs[static_cast<size_t>(a->link_item[k])];  // (null: an empty grad's)
    return true;
  }
  if (!is_tensor(t)) return false;
  *out = THPVariable_Unpack(t).const_data_ptr();
  return true;
}

const char* kAddresses = "optguard.native.Addresses";

void drop_addresses(PyObject* capsule) {
  delete static_cast<Addresses*>(PyCapsule_GetPointer(capsule, kAddresses));
}

PyObject* addresses(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 3 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1]) ||
      (nargs == 3 && (!PyList_Check(args[2]) ||
                      PyList_GET_SIZE(args[2]) != PyList_GET_SIZE(args[0])))) {
    PyErr_SetString(PyExc_TypeError,
                    "addresses(indices: list[int], checked: list[bool], links: list of None or "
                    "(spec, item), all of the same length)");
    return nullptr;
  }
  auto* out = new Addresses();
  for (Py_ssize_t k = 0; k < PyList_GET_SIZE(args[0]); ++k) {
    Py_ssize_t i = PyLong_AsSsize_t(PyList_GET_ITEM(args[0], k));
    if (i == -1 && PyErr_Occurred()) {
      delete out;
      return nullptr;
    }
    out->indices.push_back(i < 0 ? -1 : i);
    out->checked.push_back(i >= 0 && PyList_GET_ITEM(args[1], k) == Py_True);
    PyObject* link = nargs == 3 ? PyList_GET_ITEM(args[2], k) : Py_None;
    Spec* s = nullptr;
    Py_ssize_t item = -1;
    if (link != Py_None) {
      if (!PyTuple_Check(link) || PyTuple_GET_SIZE(link) != 2) {
        PyErr_SetString(PyExc_TypeError, "addresses: a link is None or (spec, item)");
        delete out;
        return nullptr;
      }
      PyObject* capsule = PyTuple_GET_ITEM(link, 0);
      s = static_cast<Spec*>(PyCapsule_GetPointer(capsule, kCapsule));
      item = PyLong_AsSsize_t(PyTuple_GET_ITEM(link, 1));
      if (s == nullptr || (item == -1 && PyErr_Occurred())) {
        delete out;
        return nullptr;
      }
      if (!s->by_address || item < 0 || item >= static_cast<Py_ssize_t>(s->metas.size())) {
        PyErr_SetString(PyExc_ValueError,
                        "addresses: a link's spec is not by_address or its item is out of range");
        delete out;
        return nullptr;
      }
      Py_INCREF(capsule);
      out->owned.push_back(capsule);
    }
    out->link_spec.push_back(s);
    out->link_item.push_back(item);
  }
  out->ptrs.assign(out->indices.size(), nullptr);
  return PyCapsule_New(out, kAddresses, drop_addresses);
}

PyObject* addresses_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "addresses_equal(addresses, tensors: list)");
    return nullptr;
  }
  auto* a = static_cast<Addresses*>(PyCapsule_GetPointer(args[0], kAddresses));
  if (a == nullptr) return nullptr;
  PyObject* tensors = args[1];
  if (!a->recorded || !PyList_Check(tensors)) Py_RETURN_FALSE;
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  try {
    for (size_t k = 0; k < a->indices.size(); ++k) {
      if (!a->checked[k]) continue;
      Py_ssize_t i = a->indices[k];
      if (i >= n) Py_RETURN_FALSE;
      const void* ptr = nullptr;
      if (!address_of(a, k, PyList_GET_ITEM(tensors, i), &ptr) || ptr != a->ptrs[k])
        Py_RETURN_FALSE;
    }
  } catch (const std::exception&) {  // a tensor without storage: not the recorded address
    Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

PyObject* addresses_record(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "addresses_record(addresses, tensors: list)");
    return nullptr;
  }
  auto* a = static_cast<Addresses*>(PyCapsule_GetPointer(args[0], kAddresses));
  if (a == nullptr) return nullptr;
  PyObject* tensors = args[1];
  Py_ssize_t n = PyList_GET_SIZE(tensors);
  std::vector<const void*> ptrs(a->indices.size(), nullptr);
  for (size_t k = 0; k < a->indices.size(); ++k) {
    Py_ssize_t i = a->indices[k];
    if (i < 0) continue;
    PyObject* t = i < n ? PyList_GET_ITEM(tensors, i) : nullptr;
    try {
      if (t == nullptr || !address_of(a, k, t, &ptrs[k])) {
        PyErr_Format(PyExc_TypeError,
                     "addresses_record: input %zd is not a tensor (nor linked to grads read "
                     "by address on this call)",
                     i);
        return nullptr;
      }
    } catch (const std::exception& e) {
      PyErr_Format(PyExc_RuntimeError, "addresses_record: input %zd: %s", i, e.what());
      return nullptr;
    }
  }
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(ptrs.size()));
  if (out == nullptr) return nullptr;
  for (size_t k = 0; k < ptrs.size(); ++k) {
    PyObject* ptr = PyLong_FromVoidPtr(const_cast<void*>(ptrs[k]));
    if (ptr == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(k), ptr);
  }
  a->ptrs = std::move(ptrs);
  a->recorded = true;
  return out;
}

// -- held tensors: their data pointers and metadata, with no fetching, no Python ints ----

// The held tensors' expected values: one record each, walked in order (no pointer to chase
// per tensor but the tensor itself), their sizes and strides flat in one array.
struct HeldTensor {
  PyObject* tensor;  // owned
  PyObject* type;    // owned: its Python type
  // Its TensorImpl when held: not owned (an owned one would make torch.utils.swap_tensors
  // refuse the tensor), so never dereferenced, only compared and handed to the prefetcher
  // (which never faults).
  const c10::TensorImpl* impl;
  const void* ptr;
  size_t offset;  // where its entry in ``dims`` starts: its dim count, sizes, strides
  c10::DispatchKeySet keys;  // its layout and device type among them
  c10::Device device;
  c10::ScalarType dtype;
  bool requires_grad;
  bool check_ptr;  // false: the address may change (no DataPtrGuard on it)
};

struct Held {
  std::vector<HeldTensor> tensors;
  std::vector<int64_t> dims;
  ~Held() {
    for (HeldTensor& h : tensors) {
      Py_DECREF(h.tensor);
      Py_DECREF(h.type);
    }
  }
};

const char* kHeld = "optguard.native.Held";

void drop_held(PyObject* capsule) { delete static_cast<Held*>(PyCapsule_GetPointer(capsule, kHeld)); }

PyObject* held(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyList_Check(args[1]) ||
      PyList_GET_SIZE(args[0]) != PyList_GET_SIZE(args[1])) {
    PyErr_SetString(PyExc_TypeError, "held(tensors: list, ptrs: list of the same length)");
    return nullptr;
  }
  auto* out = new Held();
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[0]); ++i) {
    PyObject* t = PyList_GET_ITEM(args[0], i);
    PyObject* expected = PyList_GET_ITEM(args[1], i);
    const bool check_ptr = expected != Py_None;
    void* ptr = check_ptr ? PyLong_AsVoidPtr(expected) : nullptr;
    if (!THPVariable_Check(t) || (ptr == nullptr && PyErr_Occurred())) {
      delete out;
      PyErr_Clear();
      PyErr_Format(PyExc_TypeError, "held: item %zd is not a tensor with an int pointer", i);
      return nullptr;
    }
    const at::Tensor& tensor = THPVariable_Unpack(t);
    auto* type = reinterpret_cast<PyObject*>(Py_TYPE(t));
    Py_INCREF(t);
    Py_INCREF(type);
    out->tensors.push_back(HeldTensor{t, type, tensor.unsafeGetTensorImpl(), ptr,
                                      out->dims.size(), tensor.key_set(), tensor.device(),
                                      tensor.scalar_type(), tensor.requires_grad(), check_ptr});
    out->dims.push_back(tensor.dim());
    out->dims.insert(out->dims.end(), tensor.sizes().begin(), tensor.sizes().end());
    out->dims.insert(out->dims.end(), tensor.strides().begin(), tensor.strides().end());
  }
  return PyCapsule_New(out, kHeld, drop_held);
}

// Whether every held tensor keeps its data pointer (where checked) and metadata.
bool held_ok(const Held* h) {
  try {
    // Tens of thousands of tensors outgrow the caches: each check waits on memory three
    // times (the Python object, its impl, its storage). Those of later tensors are
    // requested ahead, the storage once the impl it hangs from has arrived.
    constexpr size_t kAhead = 8;
    const HeldTensor* all = h->tensors.data();
    const size_t n = h->tensors.size();
    for (size_t i = 0; i < n; ++i) {
      if (i + kAhead < n) {
        __builtin_prefetch(all[i + kAhead].tensor);
        __builtin_prefetch(all[i + kAhead].impl);
      }
      if (i + kAhead / 2 < n && all[i + kAhead / 2].check_ptr) {
        // (through the live object: its impl is the one to read)
        const c10::TensorImpl* ahead =
            THPVariable_Unpack(all[i + kAhead / 2].tensor).unsafeGetTensorImpl();
        __builtin_prefetch(ahead->unsafe_storage().unsafeGetStorageImpl());
      }
      const HeldTensor& e = all[i];
      const at::Tensor& t = THPVariable_Unpack(e.tensor);
      const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      if (impl != e.impl || reinterpret_cast<PyObject*>(Py_TYPE(e.tensor)) != e.type)
        return false;  // swap_tensors, __class__ assigned
      const int64_t* expected = h->dims.data() + e.offset;
      const int64_t dim = expected[0];
      // (requires_grad: no autograd meta, none asked for; the layout, with the device's
      // type, is in the dispatch keys)
      if (impl->dtype().toScalarType() != e.dtype || impl->dim() != dim ||
          impl->key_set() != e.keys || impl->device() != e.device ||
          (impl->autograd_meta() == nullptr ? e.requires_grad
                                            : impl->requires_grad() != e.requires_grad))
        return false;
      c10::IntArrayRef sizes = impl->sizes();
      c10::IntArrayRef strides = impl->strides();
      for (int64_t d = 0; d < dim; ++d)
        if (sizes[d] != expected[1 + d] || strides[d] != expected[1 + dim + d]) return false;
      if (e.check_ptr && t.const_data_ptr() != e.ptr) return false;
    }
  } catch (const std::exception&) {  // a tensor without storage: not the expected address
    return false;
  }
  return true;
}

PyObject* held_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "held_match(held, *ignored)");
    return nullptr;
  }
  auto* h = static_cast<Held*>(PyCapsule_GetPointer(args[0], kHeld));
  if (h == nullptr) return nullptr;
  if (held_ok(h)) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

#ifdef OPT_DICT_VERSIONS
// -- dict versions: a dict and each of its values (dicts), in one loop -------------------

struct Versions {
  uint64_t outer;
  std::vector<uint64_t> entries;  // by position
};

const char* kVersions = "optguard.native.Versions";

void drop_versions(PyObject* capsule) {
  delete static_cast<Versions*>(PyCapsule_GetPointer(capsule, kVersions));
}

uint64_t tag(PyObject* d) { return reinterpret_cast<PyDictObject*>(d)->ma_version_tag; }

PyObject* versions(PyObject*, PyObject* d) {
  if (!PyDict_Check(d)) {
    PyErr_SetString(PyExc_TypeError, "versions(d: dict of dicts)");
    return nullptr;
  }
  auto* out = new Versions{tag(d), {}};
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) {
    if (!PyDict_Check(value)) {
      delete out;
      PyErr_SetString(PyExc_TypeError, "versions: a value is not a dict");
      return nullptr;
    }
    out->entries.push_back(tag(value));
  }
  return PyCapsule_New(out, kVersions, drop_versions);
}

PyObject* versions_match(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "versions_match(spec, d)");
    return nullptr;
  }
  auto* v = static_cast<Versions*>(PyCapsule_GetPointer(args[0], kVersions));
  if (v == nullptr) return nullptr;
  PyObject* d = args[1];
  // The same outer tag: the same dict, with the same value objects in the same order.
  if (!PyDict_Check(d) || tag(d) != v->outer) Py_RETURN_FALSE;
  Py_ssize_t pos = 0;
  size_t i = 0;
  PyObject *key, *value;
  while (PyDict_Next(d, &pos, &key, &value)) {
    if (i >= v->entries.size() || !PyDict_Check(value) || tag(value) != v->entries[i])
      Py_RETURN_FALSE;
    ++i;
  }
  if (i != v->entries.size()) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// Not a dict (a mapping of another type): a new object, equal to no other (never unchanged).
PyObject* dict_version(PyObject*, PyObject* d) {
  if (!PyDict_Check(d))
    return PyObject_CallNoArgs(reinterpret_cast<PyObject*>(&PyBaseObject_Type));
  return PyLong_FromUnsignedLongLong(tag(d));
}
#endif

// -- host-to-device copies through the CUDA driver ---------------------------------------
//
// torch's copy_ from pinned memory costs a plan's call ~10 µs of host time (dispatch, a
// TensorIterator, an event its pinned-memory allocator records per copy); the driver's
// cuMemcpyHtoDAsync queues the same copy on the same stream for well under 1 µs. The driver
// is found with dlopen among the libraries already loaded (torch's CUDA runtime loads it), so
// the module needs no CUDA headers or libraries to build, and a process without CUDA never
// loads it. A copy is queued only when the calling thread's current context is the primary
// context of ``device`` (the one torch's runtime calls use, and the stream belongs to);
// otherwise, or without the driver, h2d returns False and the caller copies with torch.

struct Driver {
  using Copy = int (*)(unsigned long long, const void*, size_t, void*);  // cuMemcpyHtoDAsync
  using Current = int (*)(void**);                                        // cuCtxGetCurrent
  using DeviceGet = int (*)(int*, int);                                   // cuDeviceGet
  using Retain = int (*)(void**, int);  // cuDevicePrimaryCtxRetain
  using Launch = int (*)(void*, void*);  // cuGraphLaunch (a cudaGraphExec_t, a stream)
  bool tried = false;
  Launch launch = nullptr;
  Copy copy = nullptr;
  Current current = nullptr;
  DeviceGet device_get = nullptr;
  Retain retain = nullptr;
  std::vector<void*> primary;  // each device's primary context (retained for good), or null
};

Driver g_driver;  // used with the GIL held

bool driver_loaded() {
  Driver& d = g_driver;
  if (!d.tried) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == nullptr) return false;  // not loaded yet: no CUDA work so far (try again later)
    d.tried = true;
    d.copy = reinterpret_cast<Driver::Copy>(dlsym(lib, "cuMemcpyHtoDAsync_v2"));
    d.current = reinterpret_cast<Driver::Current>(dlsym(lib, "cuCtxGetCurrent"));
    d.device_get = reinterpret_cast<Driver::DeviceGet>(dlsym(lib, "cuDeviceGet"));
    d.retain = reinterpret_cast<Driver::Retain>(dlsym(lib, "cuDevicePrimaryCtxRetain"));
    d.launch = reinterpret_cast<Driver::Launch>(dlsym(lib, "cuGraphLaunch"));
  }
  return d.copy != nullptr && d.current != nullptr && d.device_get != nullptr &&
         d.retain != nullptr;
}

void* primary_context(long device) {
  Driver& d = g_driver;
  if (device < 0 || device > 4096) return nullptr;
  if (static_cast<size_t>(device) >= d.primary.size()) d.primary.resize(device + 1, nullptr);
  void*& ctx = d.primary[device];
  if (ctx == nullptr) {
    int handle = 0;
    void* out = nullptr;
    if (d.device_get(&handle, static_cast<int>(device)) == 0 && d.retain(&out, handle) == 0)
      ctx = out;
  }
  return ctx;
}

PyObject* h2d(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5) {
    PyErr_SetString(PyExc_TypeError, "h2d(dst, src, nbytes, stream, device: int)");
    return nullptr;
  }
  unsigned long long dst = PyLong_AsUnsignedLongLong(args[0]);
  void* src = PyLong_AsVoidPtr(args[1]);
  size_t nbytes = PyLong_AsSize_t(args[2]);
  void* stream = PyLong_AsVoidPtr(args[3]);
  long device = PyLong_AsLong(args[4]);
  if (PyErr_Occurred()) return nullptr;
  if (!driver_loaded()) Py_RETURN_FALSE;
  void* expected = primary_context(device);
  void* current = nullptr;
  if (expected == nullptr || g_driver.current(&current) != 0 || current != expected)
    Py_RETURN_FALSE;
  if (g_driver.copy(dst, src, nbytes, stream) != 0) Py_RETURN_FALSE;
  Py_RETURN_TRUE;
}

// -- a bucket's update replayed from its trigger's hook (optcompile.backward_direct) ----
//
// An in-backward bucket whose update is one CUDA graph's replay and nothing else (no host
// value to compute, no side effect to replay) is updated here, in autograd's engine thread,
// when its trigger parameter's gradient is accumulated: no Python frame runs. The hook
// wraps the trigger's post-accumulate-grad hooks (the Python dict's, which runs instead
// whenever a check fails). Armed from Python after an update that ran in Python, with:
// the dicts whose version tags must stand, the lists whose items must stay, attributes
// that must still be given objects (the compiled entry, its graph's node), the held
// tensors (params, state: pointers and metadata), the bucket's params, whose grads must
// all be there with the metadata and data pointers of that update (the graph's address
// tables hold those), the graph's executable, device and stream. A replay then clears the
// grads (as ``p.grad = None`` does) and counts itself; Python folds the counts into the
// graph's.
//
//   direct_gate() -> capsule                  the graph task a backward's first hook found
//   gate_open(gate, task)                     clean (no gradient held): the hooks of that
//                                             task may replay; -1: none may
//   direct_new(gate) -> capsule               an unarmed Direct
//   direct_arm(direct, dicts, lists, attrs, hooks, held, params, exec, device, stream_id,
//              stream, needs_pending) -> bool
//                                             armed (False: a grad missing or not plain)
//   direct_disarm(direct)
//   direct_pending(direct, task, columns)     a host-mode bucket (needs_pending): for the
//                                             backward ``task``, the CPU columns (ptr, the
//                                             bytes they hold, the bytes to write) its host
//                                             values were computed from and sent for
//   direct_retag(direct, dicts)               the armed tags of those dicts taken anew (a
//                                             param group synced and its numbers restaged)
//   direct_install(direct, param) -> bool     wrap param's post-accumulate-grad hooks
//   direct_uninstall(direct, param) -> bool   unwrap them (if this Direct's wrapper is there)
//   direct_stats(direct) -> (replays, [fallbacks per reason], nanoseconds spent firing)

struct Gate {
  int64_t task = -2;
};

const char* kGate = "optguard.native.Gate";
const char* kDirect = "optguard.native.Direct";

enum Reason {
  kNotArmed,
  kTask,
  kAutocast,
  kObjects,
  kTensors,
  kGrads,
  kDevice,
  kLaunch,
  kPending,
  kReasons
};

// A CPU column of 0-dim inputs (step counts) a host-mode plan reads: what it must hold when
// the hook fires and what the update writes into it (the host values computed from those
// were sent at the backward's first hook).
struct Column {
  char* ptr;
  std::string old_bytes;
  std::string new_bytes;
};

struct Direct {
  std::shared_ptr<Gate> gate;
  bool armed = false;
  std::vector<std::pair<PyObject*, uint64_t>> dicts;                 // owned, their tags
  std::vector<std::pair<PyObject*, std::vector<PyObject*>>> lists;  // owned; items by address
  std::vector<std::tuple<PyObject*, PyObject*, PyObject*>> attrs;   // owned (obj, name, is)
  PyObject* held = nullptr;                                          // owned Held capsule
  std::vector<PyObject*> params;                                     // owned
  std::vector<Meta> grads;
  void* exec = nullptr;
  int device = -1;
  int64_t stream_id = 0;
  void* stream = nullptr;
  c10::DispatchKeySet autocast;  // the autocast keys excluded when armed (all: none on)
  bool needs_pending = false;    // host values: replays only with columns staged for its task
  int64_t pending_task = -3;
  std::vector<Column> columns;
  int64_t replays = 0;
  int64_t fallbacks[kReasons] = {};
  int64_t nanos = 0;  // spent in fire() (the GIL taken, checks, replays, grads cleared)

  void clear() {
    armed = false;
    for (auto& d : dicts) Py_DECREF(d.first);
    for (auto& l : lists) Py_DECREF(l.first);
    for (auto& a : attrs) {
      Py_DECREF(std::get<0>(a));
      Py_DECREF(std::get<1>(a));
      Py_DECREF(std::get<2>(a));
    }
    for (PyObject* p : params) Py_DECREF(p);
    Py_CLEAR(held);
    dicts.clear();
    lists.clear();
    attrs.clear();
    params.clear();
    grads.clear();
    exec = nullptr;
    needs_pending = false;
    pending_task = -3;
    columns.clear();
  }
  ~Direct() {
    if (Py_IsInitialized()) {
      PyGILState_STATE g = PyGILState_Ensure();
      clear();
      PyGILState_Release(g);
    }
  }

  bool fail(Reason r) {
    ++fallbacks[r];
    return false;
  }

  // With the GIL held: every check, then the replay and the grads cleared.
  bool fire_locked() {
    if (!armed || exec == nullptr) return fail(kNotArmed);
    if (static_cast<int64_t>(torch::autograd::get_current_graph_task_id()) != gate->task)
      return fail(kTask);
    if ((c10::impl::tls_local_dispatch_key_set().excluded_ & c10::autocast_dispatch_keyset) !=
        autocast)
      return fail(kAutocast);
    if (at::impl::torch_function_mode_enabled()) return fail(kObjects);
#ifdef OPT_DICT_VERSIONS
    for (auto& d : dicts)
      if (tag(d.first) != d.second) return fail(kObjects);
#else
    return fail(kObjects);
#endif
    for (auto& l : lists) {
      const std::vector<PyObject*>& items = l.second;
      if (PyList_GET_SIZE(l.first) != static_cast<Py_ssize_t>(items.size()))
        return fail(kObjects);
      for (size_t i = 0; i < items.size(); ++i)
        if (PyList_GET_ITEM(l.first, i) != items[i]) return fail(kObjects);
    }
    for (auto& a : attrs) {
      PyObject* v = PyObject_GetAttr(std::get<0>(a), std::get<1>(a));
      if (v == nullptr) {
        PyErr_Clear();
        return fail(kObjects);
      }
      Py_DECREF(v);
      if (v != std::get<2>(a)) return fail(kObjects);
    }
    if (!held_ok(static_cast<Held*>(PyCapsule_GetPointer(held, kHeld)))) return fail(kTensors);
    try {
      for (size_t i = 0; i < params.size(); ++i)
        if (!grad_matches(grads[i], THPVariable_Unpack(params[i]).grad())) return fail(kGrads);
      void* expected = primary_context(device);
      void* current = nullptr;
      if (!driver_loaded() || g_driver.launch == nullptr || expected == nullptr ||
          g_driver.current(&current) != 0 || current != expected)
        return fail(kDevice);
      c10::Device where(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device));
      if (c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(where).id() !=
          stream_id)
        return fail(kDevice);
      if (needs_pending) {
        if (pending_task != gate->task) return fail(kPending);
        for (const Column& c : columns)
          if (std::memcmp(c.ptr, c.old_bytes.data(), c.old_bytes.size()) != 0)
            return fail(kPending);
        for (const Column& c : columns) std::memcpy(c.ptr, c.new_bytes.data(), c.new_bytes.size());
      }
      if (g_driver.launch(exec, stream) != 0) {
        for (const Column& c : columns) std::memcpy(c.ptr, c.old_bytes.data(), c.old_bytes.size());
        return fail(kLaunch);
      }
      pending_task = -3;
      for (PyObject* p : params) THPVariable_Unpack(p).mutable_grad().reset();
    } catch (const std::exception&) {
      return fail(kDevice);
    }
    ++replays;
    return true;
  }

  bool fire() {
    const auto start = std::chrono::steady_clock::now();
    PyGILState_STATE g = PyGILState_Ensure();
    bool done = fire_locked();
    nanos += std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now() - start)
                 .count();
    PyGILState_Release(g);
    return done;
  }
};

struct DirectHook final : torch::autograd::PostAccumulateGradHook {
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> inner;
  std::shared_ptr<Direct> direct;
  DirectHook(std::unique_ptr<torch::autograd::PostAccumulateGradHook> inner,
             std::shared_ptr<Direct> direct)
      : inner(std::move(inner)), direct(std::move(direct)) {}
  void operator()(const at::Tensor& tensor) override {
    if (direct->fire()) return;
    (*inner)(tensor);
  }
  // Under compiled autograd the Python hooks are captured as they would be unwrapped.
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    inner->compiled_args(args);
  }
  void apply_with_saved(at::Tensor& tensor,
                        torch::dynamo::autograd::SwapSavedVariables& saved) override {
    inner->apply_with_saved(tensor, saved);
  }
};

void drop_gate(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Gate>*>(PyCapsule_GetPointer(capsule, kGate));
}

void drop_direct(PyObject* capsule) {
  delete static_cast<std::shared_ptr<Direct>*>(PyCapsule_GetPointer(capsule, kDirect));
}

std::shared_ptr<Direct>* direct_of(PyObject* capsule) {
  return static_cast<std::shared_ptr<Direct>*>(PyCapsule_GetPointer(capsule, kDirect));
}

PyObject* direct_gate(PyObject*, PyObject*) {
  return PyCapsule_New(new std::shared_ptr<Gate>(std::make_shared<Gate>()), kGate, drop_gate);
}

PyObject* gate_open(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "gate_open(gate, task: int)");
    return nullptr;
  }
  auto* gate = static_cast<std::shared_ptr<Gate>*>(PyCapsule_GetPointer(args[0], kGate));
  long long task = PyLong_AsLongLong(args[1]);
  if (gate == nullptr || PyErr_Occurred()) return nullptr;
  (*gate)->task = task;
  Py_RETURN_NONE;
}

PyObject* direct_new(PyObject*, PyObject* gate_capsule) {
  auto* gate = static_cast<std::shared_ptr<Gate>*>(PyCapsule_GetPointer(gate_capsule, kGate));
  if (gate == nullptr) return nullptr;
  auto direct = std::make_shared<Direct>();
  direct->gate = *gate;
  return PyCapsule_New(new std::shared_ptr<Direct>(std::move(direct)), kDirect, drop_direct);
}

PyObject* direct_arm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 12 || !PyList_Check(args[1]) || !PyList_Check(args[2]) ||
      !PyList_Check(args[3]) || !PyList_Check(args[6])) {
    PyErr_SetString(PyExc_TypeError,
                    "direct_arm(direct, dicts, lists, attrs, hooks, held, params: list, exec, "
                    "device, stream_id, stream, needs_pending)");
    return nullptr;
  }
  auto* found = direct_of(args[0]);
  if (found == nullptr || PyCapsule_GetPointer(args[5], kHeld) == nullptr) return nullptr;
  void* exec = PyLong_AsVoidPtr(args[7]);
  long device = PyLong_AsLong(args[8]);
  long long stream_id = PyLong_AsLongLong(args[9]);
  void* stream = PyLong_AsVoidPtr(args[10]);
  int needs_pending = PyObject_IsTrue(args[11]);
  if (PyErr_Occurred()) return nullptr;
  Direct& d = **found;
  d.clear();
#ifndef OPT_DICT_VERSIONS
  Py_RETURN_FALSE;
#else
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[1]); ++i) {
    PyObject* v = PyList_GET_ITEM(args[1], i);
    if (!PyDict_Check(v)) {
      PyErr_SetString(PyExc_TypeError, "direct_arm: dicts holds a non-dict");
      return nullptr;
    }
    Py_INCREF(v);
    d.dicts.emplace_back(v, tag(v));
  }
  PyObject* hooks = args[4];
  if (!PyDict_Check(hooks)) {
    PyErr_SetString(PyExc_TypeError, "direct_arm: hooks is not a dict");
    return nullptr;
  }
  Py_INCREF(hooks);
  d.dicts.emplace_back(hooks, tag(hooks));
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[2]); ++i) {
    PyObject* v = PyList_GET_ITEM(args[2], i);
    if (!PyList_Check(v)) {
      d.clear();
      PyErr_SetString(PyExc_TypeError, "direct_arm: lists holds a non-list");
      return nullptr;
    }
    std::vector<PyObject*> items(PyList_GET_SIZE(v));
    for (size_t k = 0; k < items.size(); ++k) items[k] = PyList_GET_ITEM(v, k);
    Py_INCREF(v);
    d.lists.emplace_back(v, std::move(items));
  }
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[3]); ++i) {
    PyObject* a = PyList_GET_ITEM(args[3], i);
    if (!PyTuple_Check(a) || PyTuple_GET_SIZE(a) != 3 || !PyUnicode_Check(PyTuple_GET_ITEM(a, 1))) {
      d.clear();
      PyErr_SetString(PyExc_TypeError, "direct_arm: attrs holds no (obj, name, value)");
      return nullptr;
    }
    PyObject* obj = PyTuple_GET_ITEM(a, 0);
    PyObject* name = PyTuple_GET_ITEM(a, 1);
    PyObject* value = PyTuple_GET_ITEM(a, 2);
    Py_INCREF(obj);
    Py_INCREF(name);
    Py_INCREF(value);
    d.attrs.emplace_back(obj, name, value);
  }
  Py_INCREF(args[5]);
  d.held = args[5];
  try {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[6]); ++i) {
      PyObject* p = PyList_GET_ITEM(args[6], i);
      if (!is_plain(p)) {
        d.clear();
        Py_RETURN_FALSE;
      }
      const at::Tensor grad = THPVariable_Unpack(p).grad();
      if (!grad.defined() || grad.layout() != c10::kStrided) {
        d.clear();
        Py_RETURN_FALSE;
      }
      Meta m;
      m.index = i;
      m.id = nullptr;
      m.none = false;
      m.type = nullptr;
      fill_tensor_meta(m, grad, true);
      Py_INCREF(p);
      d.params.push_back(p);
      d.grads.push_back(std::move(m));
    }
  } catch (const std::exception& e) {
    d.clear();
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  d.exec = exec;
  d.device = static_cast<int>(device);
  d.stream_id = stream_id;
  d.stream = stream;
  d.autocast = c10::impl::tls_local_dispatch_key_set().excluded_ & c10::autocast_dispatch_keyset;
  d.needs_pending = needs_pending != 0;
  d.armed = true;
  Py_RETURN_TRUE;
#endif
}

PyObject* direct_pending(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "direct_pending(direct, task, columns: list)");
    return nullptr;
  }
  auto* found = direct_of(args[0]);
  long long task = PyLong_AsLongLong(args[1]);
  if (found == nullptr || PyErr_Occurred()) return nullptr;
  Direct& d = **found;
  d.pending_task = -3;
  d.columns.clear();
  std::vector<Column> columns;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[2]); ++i) {
    PyObject* c = PyList_GET_ITEM(args[2], i);
    if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 3 || !PyBytes_Check(PyTuple_GET_ITEM(c, 1)) ||
        !PyBytes_Check(PyTuple_GET_ITEM(c, 2)) ||
        PyBytes_GET_SIZE(PyTuple_GET_ITEM(c, 1)) != PyBytes_GET_SIZE(PyTuple_GET_ITEM(c, 2))) {
      PyErr_SetString(PyExc_TypeError, "direct_pending: a column is no (ptr, old, new) of one size");
      return nullptr;
    }
    void* ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(c, 0));
    if (PyErr_Occurred()) return nullptr;
    PyObject* old_bytes = PyTuple_GET_ITEM(c, 1);
    PyObject* new_bytes = PyTuple_GET_ITEM(c, 2);
    columns.push_back(Column{static_cast<char*>(ptr),
                             std::string(PyBytes_AS_STRING(old_bytes), PyBytes_GET_SIZE(old_bytes)),
                             std::string(PyBytes_AS_STRING(new_bytes), PyBytes_GET_SIZE(new_bytes))});
  }
  d.columns = std::move(columns);
  d.pending_task = task;
  Py_RETURN_NONE;
}

PyObject* direct_retag(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "direct_retag(direct, dicts: list)");
    return nullptr;
  }
  auto* found = direct_of(args[0]);
  if (found == nullptr) return nullptr;
#ifdef OPT_DICT_VERSIONS
  for (auto& d : (*found)->dicts)
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(args[1]); ++i)
      if (PyList_GET_ITEM(args[1], i) == d.first) d.second = tag(d.first);
#endif
  Py_RETURN_NONE;
}

PyObject* direct_disarm(PyObject*, PyObject* capsule) {
  auto* found = direct_of(capsule);
  if (found == nullptr) return nullptr;
  (*found)->clear();
  Py_RETURN_NONE;
}

PyObject* direct_install(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !THPVariable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "direct_install(direct, param: Tensor)");
    return nullptr;
  }
  auto* found = direct_of(args[0]);
  if (found == nullptr) return nullptr;
  const at::Tensor& param = THPVariable_Unpack(args[1]);
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  if (slot == nullptr) Py_RETURN_FALSE;  // no Python hook to fall back on
  if (auto* mine = dynamic_cast<DirectHook*>(slot.get())) {
    if (mine->direct == *found) Py_RETURN_TRUE;
    Py_RETURN_FALSE;  // another Direct's
  }
  slot = std::make_unique<DirectHook>(std::move(slot), *found);
  Py_RETURN_TRUE;
}

PyObject* direct_uninstall(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !THPVariable_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "direct_uninstall(direct, param: Tensor)");
    return nullptr;
  }
  auto* found = direct_of(args[0]);
  if (found == nullptr) return nullptr;
  const at::Tensor& param = THPVariable_Unpack(args[1]);
  auto& slot = torch::autograd::impl::post_acc_grad_hooks(param);
  auto* mine = dynamic_cast<DirectHook*>(slot.get());
  if (mine == nullptr || mine->direct != *found) Py_RETURN_FALSE;
  std::unique_ptr<torch::autograd::PostAccumulateGradHook> inner = std::move(mine->inner);
  slot = std::move(inner);
  Py_RETURN_TRUE;
}

PyObject* direct_stats(PyObject*, PyObject* capsule) {
  auto* found = direct_of(capsule);
  if (found == nullptr) return nullptr;
  const Direct& d = **found;
  PyObject* fallbacks = PyList_New(kReasons);
  if (fallbacks == nullptr) return nullptr;
  for (int r = 0; r < kReasons; ++r) PyList_SET_ITEM(fallbacks, r, PyLong_FromLongLong(d.fallbacks[r]));
  return Py_BuildValue("(LNL)", static_cast<long long>(d.replays), fallbacks,
                       static_cast<long long>(d.nanos));
}

PyMethodDef kMethods[] = {
    {"plain", plain, METH_O, "Set the types whose .grad is read in C++."},
    {"spec", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(spec)), METH_FASTCALL,
     "Record the metadata (and identity) of a list of tensors (or None)."},
    {"match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(match)), METH_FASTCALL,
     "Whether a list's items (or their .grad) still match a spec."},
    {"match_both", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(match_both)),
     METH_FASTCALL, "match(grads, True, c) and match(items, False, c) in one visit."},
    {"grads", grads, METH_O, "[o.grad for o in objects]."},
    {"clear_grads", clear_grads, METH_O, "o.grad = None for o in objects."},
    {"count_grads", count_grads, METH_O, "How many of objects have a grad."},
    {"take", take, METH_O, "The grads the last passing match of a spec read (once), or None."},
    {"take_locals", take_locals, METH_O,
     "The DTensors' local tensors the last passing match of a spec read (once), or None."},
    {"by_address", by_address, METH_O,
     "A spec's passing grad matches keep the grads' data pointers (for linked addresses)."},
    {"addresses", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(addresses)),
     METH_FASTCALL, "Positions of inputs whose data pointers are recorded and compared."},
    {"addresses_equal",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(addresses_equal)), METH_FASTCALL,
     "Whether the checked inputs keep the data pointers last recorded."},
    {"addresses_record",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(addresses_record)),
     METH_FASTCALL, "Record (and return) the inputs' data pointers, 0 for a -1 position."},
    {"held", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(held)), METH_FASTCALL,
     "Hold tensors, the data pointers and the metadata they must keep."},
    {"held_match", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(held_match)),
     METH_FASTCALL, "Whether every held tensor keeps its data pointer and metadata."},
#ifdef OPT_DICT_VERSIONS
    {"versions", versions, METH_O, "The version tags of a dict and of its values (dicts)."},
    {"versions_match",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(versions_match)), METH_FASTCALL,
     "Whether a dict and each of its values keep their version tags."},
    {"dict_version", dict_version, METH_O, "A dict's own version tag."},
#endif
    {"h2d", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(h2d)), METH_FASTCALL,
     "Queue a host-to-device copy through the CUDA driver (False: not queued)."},
    {"direct_gate", direct_gate, METH_NOARGS, "A gate: the graph task whose hooks may replay."},
    {"gate_open", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(gate_open)),
     METH_FASTCALL, "Let the hooks of one graph task replay (-1: none)."},
    {"direct_new", direct_new, METH_O, "An unarmed direct update behind a gate."},
    {"direct_arm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_arm)),
     METH_FASTCALL, "Arm a direct update with what must stand and the graph it replays."},
    {"direct_disarm", direct_disarm, METH_O, "Disarm a direct update."},
    {"direct_pending",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_pending)), METH_FASTCALL,
     "The CPU columns a host-mode replay of one backward checks and writes."},
    {"direct_retag", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_retag)),
     METH_FASTCALL, "Take the dicts' tags now as the ones a direct update expects."},
    {"direct_install",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_install)), METH_FASTCALL,
     "Wrap a param's post-accumulate-grad hooks with a direct update."},
    {"direct_uninstall",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(direct_uninstall)),
     METH_FASTCALL, "Unwrap a param's post-accumulate-grad hooks."},
    {"direct_stats", direct_stats, METH_O, "(replays, fallbacks per reason) of a direct update."},
    {nullptr, nullptr, 0, nullptr}};

#define OPT_STR2(x) #x
#define OPT_STR(x) OPT_STR2(x)
#define OPT_CAT2(a, b) a##b
#define OPT_CAT(a, b) OPT_CAT2(a, b)

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, OPT_STR(TORCH_EXTENSION_NAME), nullptr, -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC OPT_CAT(PyInit_, TORCH_EXTENSION_NAME)() {
  g_local_tensor = PyUnicode_InternFromString("_local_tensor");
  g_spec = PyUnicode_InternFromString("_spec");
  g_mesh = PyUnicode_InternFromString("mesh");
  g_placements = PyUnicode_InternFromString("placements");
  if (g_local_tensor == nullptr || g_spec == nullptr || g_mesh == nullptr ||
      g_placements == nullptr)
    return nullptr;
  return PyModule_Create(&kModule);
}
