//! The walk's two hot Python calls made cheap: instances of a slots class (`TensorRecord`,
//! `Blob`) built slot by slot, and a tensor's attributes read through their descriptors.
//!
//! Calling `TensorRecord(...)` runs its Python `__init__` (type call, argument tuple, frame):
//! ~0.7 us on a tensor whose whole native walk costs a few. A slots class whose `__new__` is
//! `object.__new__` is, after `__init__`, nothing but its slots set in order, so an instance is
//! allocated by the class's own `tp_alloc` and each slot set through its member descriptor,
//! exactly as `__init__`'s `self.x = x` does. `SlotsClass::new` checks that the class is such a
//! class (else the caller calls the class). Likewise `x.dtype` and `x.stride()` look the name up
//! on the type (and a method in the instance's dict) on every read; the descriptor found once
//! per walk, on both `Tensor` and `Parameter`, is the one those lookups find.

use std::os::raw::c_int;

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyType};

/// Slot `slot` of type `ty`, or None where it has none.
fn type_slot(ty: &Bound<'_, PyType>, slot: c_int) -> Option<std::ptr::NonNull<std::ffi::c_void>> {
    // SAFETY: `ty` is a live type object (held by the Bound); PyType_GetSlot reads any type's
    // slots from Python 3.10 on (static types included) and returns NULL for an empty one.
    std::ptr::NonNull::new(unsafe { ffi::PyType_GetSlot(ty.as_type_ptr(), slot) })
}

/// A slots class whose instances are built slot by slot.
pub(super) struct SlotsClass<'py> {
    cls: Bound<'py, PyType>,
    alloc: ffi::allocfunc,
    set: ffi::descrsetfunc,
    /// The member descriptors of the slots, in the order `make` takes their values.
    members: Vec<Bound<'py, PyAny>>,
}

impl<'py> SlotsClass<'py> {
    /// None unless `cls` is a plain slots class: `__new__` is `object.__new__`, its `__slots__`
    /// are exactly `names` and each is a member descriptor of `cls` itself.
    pub(super) fn new(cls: &Bound<'py, PyType>, names: &[&str]) -> PyResult<Option<Self>> {
        let py = cls.py();
        let member_type = py
            .import(intern!(py, "types"))?
            .getattr(intern!(py, "MemberDescriptorType"))?
            .cast_into::<PyType>()?;
        let object_new = py.get_type::<PyAny>().getattr(intern!(py, "__new__"))?;
        let slots: Vec<String> = cls.getattr(intern!(py, "__slots__"))?.extract()?;
        let mut sorted: Vec<&str> = names.to_vec();
        sorted.sort_unstable();
        let mut have: Vec<&str> = slots.iter().map(String::as_str).collect();
        have.sort_unstable();
        if !cls.getattr(intern!(py, "__new__"))?.is(&object_new) || sorted != have {
            return Ok(None);
        }
        let own = cls.getattr(intern!(py, "__dict__"))?;
        let mut members = Vec::with_capacity(names.len());
        for name in names {
            let member = own.get_item(name)?;
            if !member.get_type().is(&member_type) {
                return Ok(None);
            }
            members.push(member);
        }
        let (Some(alloc), Some(set)) = (
            type_slot(cls, ffi::Py_tp_alloc),
            type_slot(&member_type, ffi::Py_tp_descr_set),
        ) else {
            return Ok(None);
        };
        Ok(Some(SlotsClass {
            cls: cls.clone(),
            // SAFETY: these slots hold functions of exactly these signatures (Include/object.h).
            alloc: unsafe {
                std::mem::transmute::<*mut std::ffi::c_void, ffi::allocfunc>(alloc.as_ptr())
            },
            // SAFETY: as above.
            set: unsafe {
                std::mem::transmute::<*mut std::ffi::c_void, ffi::descrsetfunc>(set.as_ptr())
            },
            members,
        }))
    }

    /// A new instance with its slots set to `values` (in the order of `names`).
    pub(super) fn make(&self, values: &[&Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
        let py = self.cls.py();
        if values.len() != self.members.len() {
            return Err(PyTypeError::new_err(
                "SlotsClass::make: wrong number of values",
            ));
        }
        // SAFETY: `alloc` is the class's own tp_alloc, called as `type.__call__` would through
        // `object.__new__`; it returns a new reference with every slot NULL, or NULL with an
        // exception set.
        let obj =
            unsafe { Bound::from_owned_ptr_or_err(py, (self.alloc)(self.cls.as_type_ptr(), 0))? };
        for (member, value) in self.members.iter().zip(values) {
            // SAFETY: `member` is a member descriptor of the class of `obj`, and `set` is the
            // member descriptor type's tp_descr_set: it checks `obj`'s type, stores a new
            // reference to `value` in the slot and returns -1 with an exception set on failure.
            let rc = unsafe { (self.set)(member.as_ptr(), obj.as_ptr(), value.as_ptr()) };
            if rc < 0 {
                return Err(PyErr::fetch(py));
            }
        }
        Ok(obj)
    }
}

/// How one tensor attribute is read: its descriptor's own get function, or by name.
pub(super) enum Getter<'py> {
    Descriptor(Bound<'py, PyAny>, ffi::descrgetfunc),
    Name(Bound<'py, PyString>),
}

impl<'py> Getter<'py> {
    /// The getter of attribute `name` of `types` (the same on each, else read by name).
    pub(super) fn new(
        types: &[&Bound<'py, PyType>],
        name: &Bound<'py, PyString>,
    ) -> PyResult<Self> {
        let py = name.py();
        let getset = py
            .import(intern!(py, "types"))?
            .getattr(intern!(py, "GetSetDescriptorType"))?
            .cast_into::<PyType>()?;
        let found = types[0].getattr(name)?;
        let same = types
            .iter()
            .all(|ty| ty.getattr(name).is_ok_and(|d| d.is(&found)));
        if same
            && found.get_type().is(&getset)
            && let Some(get) = type_slot(&getset, ffi::Py_tp_descr_get)
        {
            // SAFETY: the tp_descr_get slot holds a function of this signature.
            let get = unsafe {
                std::mem::transmute::<*mut std::ffi::c_void, ffi::descrgetfunc>(get.as_ptr())
            };
            return Ok(Getter::Descriptor(found, get));
        }
        Ok(Getter::Name(name.clone()))
    }

    /// `x.<name>`.
    pub(super) fn get(&self, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Getter::Descriptor(descr, get) => {
                // SAFETY: `get` is the getset descriptor type's tp_descr_get, given live objects:
                // it checks that `x` is an instance of the descriptor's type and returns a new
                // reference or NULL with an exception set.
                unsafe {
                    let got = get(descr.as_ptr(), x.as_ptr(), ffi::Py_TYPE(x.as_ptr()).cast());
                    Bound::from_owned_ptr_or_err(x.py(), got)
                }
            }
            Getter::Name(name) => x.getattr(name),
        }
    }
}

/// How one tensor method without arguments is called: its method descriptor, or by name.
pub(super) enum Method<'py> {
    Descriptor(Bound<'py, PyAny>),
    Name(Bound<'py, PyString>),
}

impl<'py> Method<'py> {
    /// Method `name` of `types` (the same method descriptor on each, else called by name).
    pub(super) fn new(
        types: &[&Bound<'py, PyType>],
        name: &Bound<'py, PyString>,
    ) -> PyResult<Self> {
        let py = name.py();
        let method = py
            .import(intern!(py, "types"))?
            .getattr(intern!(py, "MethodDescriptorType"))?;
        let found = types[0].getattr(name)?;
        let same = types
            .iter()
            .all(|ty| ty.getattr(name).is_ok_and(|d| d.is(&found)));
        if same && found.get_type().is(&method) {
            return Ok(Method::Descriptor(found));
        }
        Ok(Method::Name(name.clone()))
    }

    /// `x.<name>()`, for an `x` whose instance dict does not shadow the method (the caller
    /// checks `x.__dict__` is empty before it uses what it read).
    pub(super) fn call(&self, x: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Method::Descriptor(descr) => {
                let end = std::ptr::null_mut::<ffi::PyObject>();
                // SAFETY: calls the method descriptor with `x` as its only argument (vectorcall,
                // no argument tuple); the NULL ends the argument list. It checks `x`'s type and
                // returns a new reference or NULL with an exception set.
                unsafe {
                    let got = ffi::PyObject_CallFunctionObjArgs(descr.as_ptr(), x.as_ptr(), end);
                    Bound::from_owned_ptr_or_err(x.py(), got)
                }
            }
            Method::Name(name) => x.call_method0(name),
        }
    }
}
