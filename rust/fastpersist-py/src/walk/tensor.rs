//! The common tensor of a state, natively: `_Walker.node` + `_Walker._tensor` for an exact
//! `torch.Tensor` or `torch.nn.Parameter` that is strided, of a dtype the format knows, not
//! nested, at most `MAX_DIMS` dimensions, not a neg or conj view, non-empty, at storage offset
//! 0, C-contiguous with the canonical strides, without attributes, and the first tensor of its
//! storage; on the CPU, or on a device (not meta) when the walker has copiers. Its record and
//! blob are the ones the Python walk makes (`TensorRecord(...)` and the lazy `Blob(None, x,
//! version, nbytes, copier)`, the copier being `walker.copiers(x)` unless the walker is
//! `host_only` and `x` on the CPU); any other tensor is the Python walk's.

use std::cell::RefCell;
use std::collections::HashMap;

use pyo3::exceptions::{PyException, PyRuntimeError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyString, PyTuple};

use super::slots::{Getter, Method, SlotsClass};
use super::{Walk, id_of};

/// `TensorRecord`'s fields, in the order of its `__init__`.
const RECORD_FIELDS: [&str; 10] = [
    "key_path",
    "kind",
    "dtype",
    "shape",
    "stride",
    "blob",
    "offset_bytes",
    "device",
    "requires_grad",
    "is_parameter",
];
/// `Blob`'s slots, in the order `Tensors::blob` gives them.
const BLOB_SLOTS: [&str; 6] = [
    "_data",
    "source",
    "version",
    "nbytes",
    "device_copier",
    "members",
];

/// A dtype seen in this walk: the dtype, its name in the format, its itemsize.
type KnownDtype<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>, u64);

/// What a plain tensor's record and blob are made of, all read before anything is written.
struct Plain<'py> {
    /// The dtype's name in the format (`TORCH_DTYPE_NAME`).
    name: Bound<'py, PyAny>,
    /// `x.shape`, the key of the cached canonical layout.
    shape: Bound<'py, PyAny>,
    /// The `storages` key: `x.data_ptr()` (the storage's base address at storage offset 0) on
    /// the CPU, `(x.data_ptr(), str(x.device))` on a device.
    key: Bound<'py, PyAny>,
    /// `x.is_cpu`.
    cpu: bool,
    /// The record's device: "cpu" or `str(x.device)`.
    device: Bound<'py, PyAny>,
    /// `x._version`, or None for an inference tensor.
    version: Bound<'py, PyAny>,
    requires_grad: Bound<'py, PyAny>,
    nbytes: u64,
}

/// Set up at a walk's first tensor: how its attributes are read and its objects built, and
/// what earlier tensors of the walk already looked up.
pub(super) struct Tensors<'py> {
    layout: Getter<'py>,
    dtype: Getter<'py>,
    is_cpu: Getter<'py>,
    is_meta: Getter<'py>,
    device: Getter<'py>,
    is_nested: Getter<'py>,
    shape: Getter<'py>,
    version: Getter<'py>,
    requires_grad: Getter<'py>,
    is_neg: Method<'py>,
    is_conj: Method<'py>,
    storage_offset: Method<'py>,
    stride: Method<'py>,
    data_ptr: Method<'py>,
    record: Option<SlotsClass<'py>>,
    blob: Option<SlotsClass<'py>>,
    /// dtype -> (its name in the format, itemsize): `TORCH_DTYPE_NAME` and `ITEMSIZE`, read once.
    dtypes: RefCell<Vec<KnownDtype<'py>>>,
    /// Shape -> `CANONICAL_CACHE[shape]`, as found there; emptied whenever Python code runs
    /// (`canonical_layout` may replace an entry).
    layouts: RefCell<HashMap<Vec<u64>, Bound<'py, PyTuple>>>,
    /// The dimensions of the tensor being read.
    dims: RefCell<Vec<u64>>,
}

impl<'py> Tensors<'py> {
    fn new(walk: &Walk<'py>) -> PyResult<Self> {
        let py = walk.py;
        let env = &walk.env;
        let types = [&env.tensor, &env.parameter];
        let getter = |name: &Bound<'py, PyString>| Getter::new(&types, name);
        let method = |name: &Bound<'py, PyString>| Method::new(&types, name);
        Ok(Tensors {
            layout: getter(intern!(py, "layout"))?,
            dtype: getter(intern!(py, "dtype"))?,
            is_cpu: getter(intern!(py, "is_cpu"))?,
            is_meta: getter(intern!(py, "is_meta"))?,
            device: getter(intern!(py, "device"))?,
            is_nested: getter(intern!(py, "is_nested"))?,
            shape: getter(intern!(py, "shape"))?,
            version: getter(intern!(py, "_version"))?,
            requires_grad: getter(intern!(py, "requires_grad"))?,
            is_neg: method(intern!(py, "is_neg"))?,
            is_conj: method(intern!(py, "is_conj"))?,
            storage_offset: method(intern!(py, "storage_offset"))?,
            stride: method(intern!(py, "stride"))?,
            data_ptr: method(intern!(py, "data_ptr"))?,
            record: SlotsClass::new(&env.record, &RECORD_FIELDS)?,
            blob: SlotsClass::new(&env.blob, &BLOB_SLOTS)?,
            dtypes: RefCell::new(Vec::new()),
            layouts: RefCell::new(HashMap::new()),
            dims: RefCell::new(Vec::new()),
        })
    }

    /// Forgets what may change while Python code runs.
    pub(super) fn python_ran(&self) {
        self.layouts.borrow_mut().clear();
    }
}

impl<'py> Walk<'py> {
    fn tensors(&self) -> PyResult<&Tensors<'py>> {
        if self.tensors.get().is_none() {
            let tensors = Tensors::new(self)?;
            let _ = self.tensors.set(tensors);
        }
        Ok(self.tensors.get().expect("set above"))
    }

    /// The node of a tensor leaf (`type(x)` is `Tensor` or `Parameter`).
    pub(super) fn tensor(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = id_of(x)?;
        if let Some(i) = self.index.get_item(&id)? {
            return self.tensor_node(&i); // reached before: recorded once
        }
        let t = self.tensors()?;
        let Some(plain) = self.plain(t, x)? else {
            return self.delegate(x, path, depth);
        };
        let i = self.records.len().into_pyobject(self.py)?.into_any();
        // `storages.setdefault(key, i)`: a storage already seen makes this tensor part of a
        // shared blob, which the Python walk groups (nothing was written here yet).
        if !self.storages.set_default(&plain.key, &i)? {
            return self.delegate(x, path, depth);
        }
        self.index.set_item(&id, &i)?;
        self.leaves.append(x)?;
        self.record(t, x, path, &plain)?;
        self.tensor_node(&i)
    }

    /// `{"t": "tensor", "i": i}`.
    fn tensor_node(&self, i: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let node = PyDict::new(self.py);
        node.set_item(intern!(self.py, "t"), intern!(self.py, "tensor"))?;
        node.set_item(intern!(self.py, "i"), i)?;
        Ok(node.into_any())
    }

    /// Appends the record and the blob of a plain tensor, as `_Walker._tensor` makes them.
    fn record(
        &self,
        t: &Tensors<'py>,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        plain: &Plain<'py>,
    ) -> PyResult<()> {
        let py = self.py;
        let none = py.None().into_bound(py);
        // `_Walker._tensor`'s choice: the copier is asked about device tensors, and about CPU
        // ones where a fake device is installed; only a tensor it reads is watched.
        let copier = match &self.copiers {
            Some(copiers) if !(plain.cpu && self.host_only) => copiers.call1((x,))?,
            _ => none.clone(),
        };
        let version = if plain.cpu || !copier.is_none() {
            &plain.version
        } else {
            &none
        };
        let layout = self.canonical(t, &plain.shape)?;
        let is_parameter = x.get_type_ptr() == self.env.parameter.as_type_ptr();
        let is_parameter = PyBool::new(py, is_parameter).to_owned().into_any();
        let fields = [
            path.as_any(),
            intern!(py, "torch").as_any(),
            &plain.name,
            &layout.get_item(0)?,
            &layout.get_item(1)?,
            &self.blobs.len().into_pyobject(py)?.into_any(),
            &0u8.into_pyobject(py)?.into_any(),
            &plain.device,
            &plain.requires_grad,
            &is_parameter,
        ];
        let record = match &t.record {
            Some(class) => class.make(&fields)?,
            None => self.env.record.call1(PyTuple::new(py, fields)?)?,
        };
        self.records.append(record)?;
        let nbytes = plain.nbytes.into_pyobject(py)?.into_any();
        let blob = match &t.blob {
            Some(class) => {
                let members = PyTuple::empty(py).into_any();
                class.make(&[&none, x, version, &nbytes, &copier, &members])?
            }
            None => self.env.blob.call1((&none, x, version, &nbytes, &copier))?,
        };
        self.blobs.append(blob)
    }

    /// `CANONICAL_CACHE.get(size) or canonical_layout(size)`: the shared shape and stride lists
    /// (`t.dims` holds the dimensions of `shape`).
    fn canonical(
        &self,
        t: &Tensors<'py>,
        shape: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        if let Some(found) = t.layouts.borrow().get(t.dims.borrow().as_slice()) {
            return Ok(found.clone());
        }
        if let Some(cached) = self.env.canonical_cache.get_item(shape)?
            && cached.is_truthy()?
        {
            let cached = cached.cast_into::<PyTuple>()?;
            let dims = t.dims.borrow().clone();
            t.layouts.borrow_mut().insert(dims, cached.clone());
            return Ok(cached);
        }
        t.python_ran();
        Ok(self.env.canonical_layout.call1((shape,))?.cast_into()?)
    }

    /// The parts of a plain tensor's record, or None for any other tensor. An exception raised
    /// while reading it is left to the Python walk, which reads the same attributes.
    fn plain(&self, t: &Tensors<'py>, x: &Bound<'py, PyAny>) -> PyResult<Option<Plain<'py>>> {
        match self.read_plain(t, x) {
            Ok(plain) => Ok(plain),
            Err(e) if e.is_instance_of::<PyException>(self.py) => Ok(None),
            Err(e) => Err(e), // KeyboardInterrupt and the like
        }
    }

    fn read_plain(&self, t: &Tensors<'py>, x: &Bound<'py, PyAny>) -> PyResult<Option<Plain<'py>>> {
        let py = self.py;
        if !t.layout.get(x)?.is(&self.env.strided) {
            return Ok(None);
        }
        let Some((name, itemsize)) = self.dtype(t, &t.dtype.get(x)?)? else {
            return Ok(None);
        };
        let cpu = t.is_cpu.get(x)?.is_truthy()?;
        if !cpu && (self.copiers.is_none() || t.is_meta.get(x)?.is_truthy()?) {
            return Ok(None); // copied to the host when read, or a meta record
        }
        if t.is_nested.get(x)?.is_truthy()?
            || t.is_neg.call(x)?.is_truthy()?
            || t.is_conj.call(x)?.is_truthy()?
            || t.storage_offset.call(x)?.extract::<i64>()? != 0
        {
            return Ok(None);
        }
        let shape = t.shape.get(x)?;
        let Some(numel) = self.canonical_numel(t, &shape, &t.stride.call(x)?)? else {
            return Ok(None);
        };
        let Some(nbytes) = numel.checked_mul(itemsize) else {
            return Ok(None);
        };
        let ptr = t.data_ptr.call(x)?;
        let (key, device) = if cpu {
            (ptr, intern!(py, "cpu").clone().into_any())
        } else {
            let device = t.device.get(x)?.str()?.into_any();
            (PyTuple::new(py, [&ptr, &device])?.into_any(), device)
        };
        let version = match t.version.get(x) {
            Ok(version) => version,
            Err(e) if e.is_instance_of::<PyRuntimeError>(py) => py.None().into_bound(py),
            Err(e) => return Err(e),
        };
        let requires_grad = t.requires_grad.get(x)?;
        // Last: an attribute in the instance dict would have shadowed the methods called above.
        let attrs = x.getattr(intern!(py, "__dict__"))?;
        if attrs.cast::<PyDict>()?.len() != 0 {
            return Ok(None); // plain attributes: a `tensor_attrs` node
        }
        Ok(Some(Plain {
            name,
            shape,
            key,
            cpu,
            device,
            version,
            requires_grad,
            nbytes,
        }))
    }

    /// `TORCH_DTYPE_NAME.get(dtype)` and its `ITEMSIZE`; None for a dtype the format lacks.
    fn dtype(
        &self,
        t: &Tensors<'py>,
        dtype: &Bound<'py, PyAny>,
    ) -> PyResult<Option<(Bound<'py, PyAny>, u64)>> {
        if let Some((_, name, size)) = t.dtypes.borrow().iter().find(|(d, _, _)| d.is(dtype)) {
            return Ok(Some((name.clone(), *size)));
        }
        let Some(name) = self.env.dtype_names.get_item(dtype)? else {
            return Ok(None);
        };
        let Some(size) = self.env.itemsizes.get_item(&name)? else {
            return Ok(None);
        };
        let size: u64 = size.extract()?;
        t.dtypes
            .borrow_mut()
            .push((dtype.clone(), name.clone(), size));
        Ok(Some((name, size)))
    }

    /// The element count of a non-empty tensor of at most `MAX_DIMS` dimensions whose strides
    /// are the C-contiguous ones `canonical_layout` gives its shape (left in `t.dims`); None
    /// for any other.
    fn canonical_numel(
        &self,
        t: &Tensors<'py>,
        shape: &Bound<'py, PyAny>,
        stride: &Bound<'py, PyAny>,
    ) -> PyResult<Option<u64>> {
        let shape = shape.cast::<PyTuple>()?;
        let stride = stride.cast::<PyTuple>()?;
        if shape.len() > self.env.max_dims || shape.len() != stride.len() {
            return Ok(None);
        }
        let mut dims = t.dims.borrow_mut();
        dims.clear();
        let mut numel: u64 = 1;
        for d in (0..shape.len()).rev() {
            let n: u64 = shape.get_item(d)?.extract()?;
            let s: u64 = stride.get_item(d)?.extract()?;
            if n == 0 || s != numel {
                return Ok(None); // empty, or not the canonical stride
            }
            let Some(next) = numel.checked_mul(n) else {
                return Ok(None);
            };
            numel = next;
            dims.push(n);
        }
        Ok(Some(numel))
    }
}
