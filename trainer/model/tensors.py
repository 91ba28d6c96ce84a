"""safetensors files <-> NumPy arrays, lazily: opening a file reads its header only; a tensor is read when it is
looked up, and a part of one can be read alone (LazyTensor), so checking a 70B checkpoint reads no weight. Read and
written with the `safetensors` library (>= 0.4.1: 0.4.0 cannot return bf16 as NumPy); ml_dtypes (a JAX dependency)
provides the bfloat16 NumPy dtype. Hugging Face checkpoints (config.json, sharded indexes) are trainer/model/hf.py's;
LoRA adapters (trainer/model/lora.py) and the service's optimizer snapshots use these files too.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

# Imported for its side effect too: safetensors' numpy framework asks for np.dtype("bfloat16"), a name NumPy only
# knows once ml_dtypes has registered it (without it, reading a BF16 tensor raises "data type 'bfloat16' not
# understood"). The writer, in turn, maps an array's dtype name "bfloat16" to BF16.
import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

# The safetensors dtypes this module reads and writes. The library knows more (F8_*, ...), but its numpy framework
# cannot return those, so they are refused when a file is opened rather than when a tensor is read.
_ST_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}


# By dtype name, so a big-endian array (which the library byte-swaps on write) is accepted too.
_WRITABLE = {dt.name for dt in _ST_DTYPES.values()}


class LazyTensor:
    """One tensor of a safetensors file: shape and dtype come from the header; the data is read only when the tensor
    is converted (`np.asarray`, `read`) or indexed, and indexing reads only the selected part (e.g. one device's
    rows). Each read is a fresh, writable copy."""

    __slots__ = ("_handle", "dtype", "name", "path", "shape")

    def __init__(self, handle: safe_open, path: Path, name: str, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self._handle = handle
        self.path = path
        self.name = name
        self.shape = shape
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def read(self) -> np.ndarray:
        """The whole tensor."""
        try:
            return self._handle.get_tensor(self.name)
        except SafetensorError as err:
            raise ValueError(f"{self.path}: tensor {self.name!r}: {err}") from None

    def __getitem__(self, index: Any) -> np.ndarray:
        """Basic indexing (ints, slices, `...`); only the selected elements are read from the file."""
        try:
            return self._handle.get_slice(self.name)[index]
        except SafetensorError as err:
            raise IndexError(f"{self.path}: tensor {self.name!r} {list(self.shape)}: {err}") from None

    def __array__(self, dtype: np.dtype | None = None, copy: bool | None = None) -> np.ndarray:
        arr = self.read()  # already a private copy, so `copy` asks nothing more of us
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __repr__(self) -> str:
        return f"LazyTensor({self.name!r}, shape={self.shape}, dtype={self.dtype}, path={str(self.path)!r})"


class LazyTensors(Mapping[str, np.ndarray]):
    """Tensors of one or more safetensors files by name, of which only the headers have been read. Looking a name up
    reads that tensor from disk, each time (nothing is cached, so a loader converting tensors one at a time holds one
    at a time); `lazy(name)` gives its shape and dtype, or a part of it, without reading the rest."""

    def __init__(self, tensors: Mapping[str, LazyTensor]) -> None:
        self._lazy = dict(tensors)

    def lazy(self, name: str) -> LazyTensor:
        return self._lazy[name]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._lazy[name].read()

    def __contains__(self, name: object) -> bool:  # Mapping's default would read the tensor
        return name in self._lazy

    def __iter__(self) -> Iterator[str]:
        return iter(self._lazy)

    def __len__(self) -> int:
        return len(self._lazy)

    def update(self, other: LazyTensors) -> None:
        """Add another file's tensors (a sharded checkpoint); a name in both is other's."""
        self._lazy.update(other._lazy)


def read_safetensors(path: str | Path) -> LazyTensors:
    """The tensors of one .safetensors file, lazily (see LazyTensors): opening reads and checks the header only."""
    path = Path(path)
    if not path.is_file():  # checked here: the library's own message does not always name the file
        raise FileNotFoundError(f"{path}: no such file" if not path.exists() else f"{path}: not a file")
    try:
        handle = safe_open(str(path), framework="numpy")
        out: dict[str, LazyTensor] = {}
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
            info = handle.get_slice(name)  # header information only; no data is read
            st_dtype = info.get_dtype()
            if st_dtype not in _ST_DTYPES:
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {st_dtype}")
            out[name] = LazyTensor(handle, path, name, tuple(info.get_shape()), _ST_DTYPES[st_dtype])
    except SafetensorError as err:  # a bad header, or a file shorter or longer than the header says
        raise ValueError(f"{path}: not a safetensors file ({err})") from None
    except OSError as err:
        raise OSError(f"{path}: {err}") from None
    return LazyTensors(out)


def write_safetensors(
    path: str | Path, tensors: Mapping[str, np.ndarray], metadata: dict[str, str] | None = None
) -> None:
    """Write tensors with safetensors' own writer (little-endian; bfloat16 arrays as BF16)."""
    arrays: dict[str, np.ndarray] = {}
    for name, tensor in tensors.items():
        arr = np.asarray(tensor)
        if arr.dtype.name not in _WRITABLE:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be written to safetensors")
        # save_file copies from the array's buffer pointer (safetensors 0.8): a strided view, e.g. a transpose,
        # would be written in memory order, silently scrambled.
        arrays[name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
    save_file(arrays, str(path), metadata=metadata)
