//! `flatten_walk`: the native walk behind `fastpersist.format.flatten`.
//!
//! An accelerator of the Python `_Walker`, not a second implementation of the format: it
//! appends to the walker's own lists and dicts (`records`, `leaves`, `blobs`, `index`,
//! `on_path`, `storages`: the interface `_Walker`'s docstring documents) and builds, for the common nodes, exactly what the Python walk
//! builds: exact dicts, OrderedDicts (their `_metadata` included), lists and tuples; str, bool,
//! None, int and float leaves; str and int dict keys; and a plain contiguous tensor that is the
//! first of its storage, on the CPU or on a device the save's copiers stage it from (`tensor.rs`). Every other node (a view, a second tensor of a
//! storage, numpy arrays, bytes, sets, namedtuples, an error to raise ...) is handed to
//! `walker.node(x, path, depth)`, the Python walk itself, which appends to the same lists: the
//! result is the Python walk's by construction. Errors the walk raises (cycles, depth) come
//! from the walker's own `enter` and `encode_key`, so their types and messages are the same too.
//!
//! `slots`: the walk's two hot Python calls made cheap (a slots-class instance built slot by slot, a
//! tensor's attributes read through their descriptors); `tensor`: the plain tensor's record.

mod slots;
mod tensor;

use std::cell::{OnceCell, RefCell};

use pyo3::PyTypeCheck;
use pyo3::exceptions::PyTypeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PySet, PyString, PyTuple, PyType};

/// Walks `state` for `walker` (a `fastpersist.format.flatten._Walker`) and returns the root
/// node of the tree spec; records, leaves and blobs are appended to the walker's lists. `env`
/// is what the walk reads from `fastpersist.format` (`nativewalk.ENV`).
#[pyfunction]
pub(crate) fn flatten_walk<'py>(
    walker: &Bound<'py, PyAny>,
    state: &Bound<'py, PyAny>,
    path: &Bound<'py, PyString>,
    env: &Bound<'py, PyDict>,
) -> PyResult<Bound<'py, PyAny>> {
    Walk::new(walker, env)?.node(state, path, 0)
}

/// What the walk reads from `fastpersist.format`: the types it recognises, the tables and
/// classes the Python walk uses, its limits.
struct Env<'py> {
    tensor: Bound<'py, PyType>,
    parameter: Bound<'py, PyType>,
    odict: Bound<'py, PyType>,
    strided: Bound<'py, PyAny>,
    dtype_names: Bound<'py, PyDict>,
    itemsizes: Bound<'py, PyDict>,
    canonical_cache: Bound<'py, PyDict>,
    canonical_layout: Bound<'py, PyAny>,
    record: Bound<'py, PyType>,
    blob: Bound<'py, PyType>,
    key_text: Bound<'py, PyAny>,
    max_depth: usize,
    max_dims: usize,
}

/// `env[name]`, of type `T`.
fn entry<'py, T: PyTypeCheck>(env: &Bound<'py, PyDict>, name: &str) -> PyResult<Bound<'py, T>> {
    match env.get_item(name)? {
        Some(value) => Ok(value.cast_into::<T>()?),
        None => Err(PyTypeError::new_err(format!(
            "flatten_walk: env lacks {name:?}"
        ))),
    }
}

impl<'py> Env<'py> {
    fn new(env: &Bound<'py, PyDict>) -> PyResult<Self> {
        Ok(Env {
            tensor: entry(env, "Tensor")?,
            parameter: entry(env, "Parameter")?,
            odict: entry(env, "OrderedDict")?,
            strided: entry(env, "strided")?,
            dtype_names: entry(env, "TORCH_DTYPE_NAME")?,
            itemsizes: entry(env, "ITEMSIZE")?,
            canonical_cache: entry(env, "CANONICAL_CACHE")?,
            canonical_layout: entry(env, "canonical_layout")?,
            record: entry(env, "TensorRecord")?,
            blob: entry(env, "Blob")?,
            key_text: entry(env, "key_text")?,
            max_depth: entry::<PyInt>(env, "MAX_DEPTH")?.extract()?,
            max_dims: entry::<PyInt>(env, "MAX_DIMS")?.extract()?,
        })
    }
}

/// One walk: the walker's containers, read once.
struct Walk<'py> {
    py: Python<'py>,
    walker: Bound<'py, PyAny>,
    records: Bound<'py, PyList>,
    leaves: Bound<'py, PyList>,
    blobs: Bound<'py, PyList>,
    index: Bound<'py, PyDict>,
    on_path: Bound<'py, PySet>,
    storages: Bound<'py, PyDict>,
    /// No copier is installed: a CPU tensor's bytes are read in place (`_Walker.host_only`).
    host_only: bool,
    /// The save's choice of the tensors it stages from their device (`_Walker.copiers`), or
    /// None: then a device tensor is the Python walk's.
    copiers: Option<Bound<'py, PyAny>>,
    env: Env<'py>,
    /// Reused to build each key path (one allocation per walk, not per node).
    text: RefCell<String>,
    /// Set up at the first tensor.
    tensors: OnceCell<tensor::Tensors<'py>>,
}

impl<'py> Walk<'py> {
    fn new(walker: &Bound<'py, PyAny>, env: &Bound<'py, PyDict>) -> PyResult<Self> {
        let py = walker.py();
        let field = |name: &Bound<'py, PyString>| walker.getattr(name);
        Ok(Walk {
            py,
            walker: walker.clone(),
            records: field(intern!(py, "records"))?.cast_into()?,
            leaves: field(intern!(py, "leaves"))?.cast_into()?,
            blobs: field(intern!(py, "blobs"))?.cast_into()?,
            index: field(intern!(py, "index"))?.cast_into()?,
            on_path: field(intern!(py, "on_path"))?.cast_into()?,
            storages: field(intern!(py, "storages"))?.cast_into()?,
            host_only: field(intern!(py, "host_only"))?.is_truthy()?,
            copiers: Some(field(intern!(py, "copiers"))?).filter(|c| !c.is_none()),
            env: Env::new(env)?,
            text: RefCell::new(String::new()),
            tensors: OnceCell::new(),
        })
    }

    /// The spec node of `x` (`_Walker.node`).
    fn node(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ty = x.get_type_ptr();
        if ty == self.env.tensor.as_type_ptr() || ty == self.env.parameter.as_type_ptr() {
            return self.tensor(x, path, depth);
        }
        if x.is_exact_instance_of::<PyString>() || x.is_exact_instance_of::<PyBool>() || x.is_none()
        {
            return Ok(x.clone());
        }
        if x.is_exact_instance_of::<PyDict>() {
            return self.mapping(x, path, depth, false);
        }
        if ty == self.env.odict.as_type_ptr() {
            return self.mapping(x, path, depth, true);
        }
        if x.is_exact_instance_of::<PyList>() {
            return self.items(x, path, depth, intern!(self.py, "list"));
        }
        if x.is_exact_instance_of::<PyTuple>() {
            return self.items(x, path, depth, intern!(self.py, "tuple"));
        }
        if x.is_exact_instance_of::<PyInt>()
            && let Some(node) = self.small_int(x)?
        {
            return Ok(node);
        }
        if let Ok(f) = x.cast_exact::<PyFloat>() {
            return self.float(f);
        }
        self.delegate(x, path, depth)
    }

    /// The Python walk's node of `x`: everything this walk does not build itself.
    fn delegate(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let node = self
            .walker
            .call_method1(intern!(self.py, "node"), (x, path, depth));
        if let Some(tensors) = self.tensors.get() {
            tensors.python_ran();
        }
        node
    }

    /// `_Walker.enter`: the depth limit and the cycle check; returns `id(x)`, now on the path.
    fn enter(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let id = id_of(x)?;
        if depth >= self.env.max_depth || self.on_path.contains(&id)? {
            // The walker raises the error, with its message (it adds `id` if it does not).
            self.walker
                .call_method1(intern!(self.py, "enter"), (x, path, depth))?;
        } else {
            self.on_path.add(&id)?;
        }
        Ok(id)
    }

    /// `_Walker._mapping`: `{"t": tag, "k": keys, "v": values}` (+ `"meta"` for an OrderedDict
    /// that carries `_metadata`).
    fn mapping(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
        odict: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let id = self.enter(x, path, depth)?;
        let keys = PyList::empty(py);
        let values = PyList::empty(py);
        // `x.items()` as the Python walk iterates it: an OrderedDict's own order, and the same
        // errors if the mapping changes size meanwhile.
        for item in x.call_method0(intern!(py, "items"))?.try_iter()? {
            let (k, v) = {
                let item = item?;
                let pair = item.cast::<PyTuple>()?;
                (pair.get_item(0)?, pair.get_item(1)?)
            }; // the item is dropped here, so that the iterator can reuse it
            let child = self.key(&k, &keys, path, depth)?;
            values.append(self.node(&v, &child, depth + 1)?)?;
        }
        let node = PyDict::new(py);
        let tag = if odict {
            intern!(py, "odict")
        } else {
            intern!(py, "dict")
        };
        node.set_item(intern!(py, "t"), tag)?;
        node.set_item(intern!(py, "k"), keys)?;
        node.set_item(intern!(py, "v"), values)?;
        if odict {
            let attrs = x.getattr(intern!(py, "__dict__"))?;
            let meta = attrs.call_method1(intern!(py, "get"), (intern!(py, "_metadata"),))?;
            if !meta.is_none() {
                let child = self.child(path, "._metadata", "", "")?;
                node.set_item(intern!(py, "meta"), self.node(&meta, &child, depth + 1)?)?;
            }
        }
        self.on_path.discard(id)?;
        Ok(node.into_any())
    }

    /// Appends dict key `k`'s spec form to `keys` and returns the child's key path.
    fn key(
        &self,
        k: &Bound<'py, PyAny>,
        keys: &Bound<'py, PyList>,
        path: &Bound<'py, PyString>,
        depth: usize,
    ) -> PyResult<Bound<'py, PyString>> {
        if let Ok(s) = k.cast_exact::<PyString>() {
            keys.append(s)?;
            return self.str_child(path, s);
        }
        if k.is_exact_instance_of::<PyInt>()
            && let Some(text) = i64_text(k)
        {
            keys.append(self.int_node(&text)?)?;
            return self.child(path, "[", &text, "]");
        }
        let py = self.py;
        keys.append(
            self.walker
                .call_method1(intern!(py, "encode_key"), (k, path, depth))?,
        )?;
        let text = self.env.key_text.call1((k,))?.cast_into::<PyString>()?;
        self.child_of(path, "[", &text, "]")
    }

    /// `f"{path}.{k}"` if `k.isidentifier()` else `f"{path}[{k!r}]"`.
    fn str_child(
        &self,
        path: &Bound<'py, PyString>,
        k: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyString>> {
        let identifier = match k.to_str().ok().and_then(ascii_identifier) {
            Some(known) => known,
            None => k // not ASCII: Python's own rule (Unicode XID)
                .call_method0(intern!(self.py, "isidentifier"))?
                .is_truthy()?,
        };
        if identifier {
            self.child_of(path, ".", k, "")
        } else {
            self.child_of(path, "[", &k.repr()?, "]")
        }
    }

    /// `_Walker._items`: the nodes of a list's or tuple's elements, as `{"t": tag, "v": [...]}`.
    fn items(
        &self,
        x: &Bound<'py, PyAny>,
        path: &Bound<'py, PyString>,
        depth: usize,
        tag: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let id = self.enter(x, path, depth)?;
        let out = PyList::empty(py);
        for (i, v) in x.try_iter()?.enumerate() {
            let child = self.child(path, "[", &i.to_string(), "]")?;
            out.append(self.node(&v?, &child, depth + 1)?)?;
        }
        self.on_path.discard(id)?;
        let node = PyDict::new(py);
        node.set_item(intern!(py, "t"), tag)?;
        node.set_item(intern!(py, "v"), out)?;
        Ok(node.into_any())
    }

    /// `path + open + mid + close`, with `mid` a Python str.
    fn child_of(
        &self,
        path: &Bound<'py, PyString>,
        open: &str,
        mid: &Bound<'py, PyString>,
        close: &str,
    ) -> PyResult<Bound<'py, PyString>> {
        match mid.to_str() {
            Ok(text) => self.child(path, open, text, close),
            Err(_) => concat(path, &[open, close], mid), // lone surrogates: Python's concatenation
        }
    }

    /// `path + open + mid + close`.
    fn child(
        &self,
        path: &Bound<'py, PyString>,
        open: &str,
        mid: &str,
        close: &str,
    ) -> PyResult<Bound<'py, PyString>> {
        let Ok(head) = path.to_str() else {
            let mid = PyString::new(self.py, mid);
            return concat(path, &[open, close], &mid);
        };
        let mut text = self.text.borrow_mut();
        text.clear();
        for part in [head, open, mid, close] {
            text.push_str(part);
        }
        Ok(PyString::new(self.py, &text))
    }

    /// `{"t": "int", "v": text}`, as `values._enc_int` writes an int.
    fn int_node(&self, text: &str) -> PyResult<Bound<'py, PyAny>> {
        let node = PyDict::new(self.py);
        node.set_item(intern!(self.py, "t"), intern!(self.py, "int"))?;
        node.set_item(intern!(self.py, "v"), text)?;
        Ok(node.into_any())
    }

    /// An int leaf that fits 64 bits (larger ones are the Python walk's: `values._int_text`).
    fn small_int(&self, x: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        i64_text(x).map(|text| self.int_node(&text)).transpose()
    }

    /// `{"t": "float", "v": x.hex()}` ("-nan" for a negative NaN), as `values._enc_float`.
    fn float(&self, x: &Bound<'py, PyFloat>) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let value = x.value();
        let node = PyDict::new(py);
        node.set_item(intern!(py, "t"), intern!(py, "float"))?;
        if value.is_nan() && value.is_sign_negative() {
            node.set_item(intern!(py, "v"), intern!(py, "-nan"))?;
        } else {
            node.set_item(intern!(py, "v"), x.call_method0(intern!(py, "hex"))?)?;
        }
        Ok(node.into_any())
    }
}

/// `id(x)`.
fn id_of<'py>(x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    Ok((x.as_ptr() as usize).into_pyobject(x.py())?.into_any())
}

/// The decimal text of an int that fits 64 bits (`str(x)`), else None.
fn i64_text(x: &Bound<'_, PyAny>) -> Option<String> {
    x.extract::<i64>().ok().map(|v| v.to_string())
}

/// `str.isidentifier()` for an ASCII string; None for any other (Python decides).
fn ascii_identifier(s: &str) -> Option<bool> {
    if !s.is_ascii() {
        return None;
    }
    let bytes = s.as_bytes();
    Some(match bytes.split_first() {
        Some((first, rest)) => {
            (first.is_ascii_alphabetic() || *first == b'_')
                && rest.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_')
        }
        None => false,
    })
}

/// `path + open + mid + close` by Python's str concatenation (strings that are not UTF-8).
fn concat<'py>(
    path: &Bound<'py, PyString>,
    [open, close]: &[&str; 2],
    mid: &Bound<'py, PyString>,
) -> PyResult<Bound<'py, PyString>> {
    Ok(path.add(*open)?.add(mid)?.add(*close)?.cast_into()?)
}
