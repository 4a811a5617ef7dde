"""numba options decided in one place.

``cache=True`` keeps the compiled kernels on disk so a second start of the CLI
does not compile again.  No fastmath: the kernels must reproduce the
pure-Python reference bit for bit, including float comparisons.

numba's on-disk cache only notices edits to the file a function lives in, not
to the kernels it calls from other files, so a stale kernel could survive an
edit.  The cache therefore lives in a folder named after a hash of every
kernel source (and the label codes and decision columns they freeze): any edit starts a fresh
cache.  A user's ``NUMBA_CACHE_DIR`` says where that folder goes: it is the
parent of the hash folder, never the cache itself (one cache folder kept
across edits once ran a stale kernel and crashed the process).

What a first start compiles: every kernel is plain ``njit``; the
engine runs a chunk's blocks on its own threads (``engine.start_blocks``; the
kernels release the GIL) instead of numba's ``parallel=True``, whose parfor
passes made the grid kernel's compile about a quarter longer; and a kernel
calling another compiles one specialization per argument type, never one per
constant value (:class:`_Dispatcher`).
"""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import threading
import zlib
from pathlib import Path

import numba
import numpy as np
from llvmlite import ir as _ir
from numba.core import cgutils as _cgutils
from numba.core import types as _types
from numba.core.caching import FunctionCache as _FunctionCache
from numba.core.registry import CPUDispatcher as _CPUDispatcher
from numba.core.runtime.nrt import rtsys as _rtsys
from numba.extending import intrinsic as _intrinsic

HELD_SIGNALS: list[int] = []
"""Stop signals that arrived while a kernel was called from Python (see :func:`holding_signals`)."""
_HOLDING = [0]


def holding_signals_now() -> bool:
    """Whether a stop signal's Python handler should hold it (a kernel call is under way)."""
    return _HOLDING[0] > 0


class holding_signals:
    """A kernel call from Python during which a stop signal's Python handler holds the signal
    (:data:`HELD_SIGNALS`) instead of raising: an exception raised while numba's wrapper runs
    Python code to read the call's arguments (a named tuple's fields) crashed the process
    (SIGSEGV) instead of unwinding.  On leaving, the first held signal is sent again, so the
    handler raises it where Python code is running."""

    def __enter__(self) -> None:
        # only the main thread runs Python's signal handlers: a pool thread's kernel holds nothing
        self.main = threading.current_thread() is threading.main_thread()
        if self.main:
            _HOLDING[0] += 1

    def __exit__(self, *exc) -> None:
        if not self.main:
            return
        _HOLDING[0] -= 1
        if _HOLDING[0] == 0 and HELD_SIGNALS:
            first = HELD_SIGNALS[0]
            HELD_SIGNALS.clear()
            signal.raise_signal(first)

_HERE = Path(__file__).resolve().parent


def _source_hash() -> str:
    h = hashlib.sha256()
    kernels = [p for p in sorted(_HERE.glob("*.py")) if p.name != "warm.py"]   # warm.py: orchestration only
    for path in kernels + [_HERE.parent / "labels.py", _HERE.parent / "fields.py"]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    h.update(numba.__version__.encode())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where the compiled kernels are cached: a folder per kernel-source hash,
    under ``NUMBA_CACHE_DIR`` when it is set, else under the user's cache folder."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / _source_hash()
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return base / "router-replay" / "numba" / _source_hash()


numba.config.CACHE_DIR = str(cache_dir())


def _arraymath_without_scipy() -> None:
    """Import numba's ``np`` function registry without importing scipy.

    numba imports ``numba.np.arraymath`` on its first compile or cache load,
    and that module asks once whether BLAS is there by importing
    ``scipy.linalg`` (about 0.4 s of a 1.9 s cached start).  The answer is used
    only to pick the inner product of ``np.correlate``/``np.convolve`` (which
    no kernel calls); ``np.dot`` and ``np.linalg`` check BLAS again, and import
    scipy, when a kernel uses them.  So the module is imported here with that
    one check answering "no BLAS".
    """

    if "numba.np.arraymath" in sys.modules or numba.config.DISABLE_JIT:
        return
    from numba.np import linalg  # lazy: numba internals, on numba's schedule

    real = getattr(linalg, "ensure_blas", None)
    if real is None:        # another numba: leave its import alone (the probe only costs time)
        return

    def no_blas():
        raise ImportError("not asked: see replay/kernels/_jit.py")

    linalg.ensure_blas = no_blas
    try:
        from numba.np import arraymath  # lazy: numba internals, on numba's schedule
    finally:
        linalg.ensure_blas = real
    arraymath.ensure_blas = real


def _registries_when_compiling() -> None:
    """Import ``numba.np.arraymath`` (:func:`_arraymath_without_scipy`) when numba
    first loads its registries, not when this module is imported: a cached
    start of our kernels loads none (:class:`_CacheLoadsOnly`), so it need not
    import that module at all."""
    from numba.core import cpu  # lazy: numba internals, on numba's schedule

    real = cpu.CPUContext.__dict__.get("load_additional_registries")
    if real is None:        # another numba: import it now, as before
        _arraymath_without_scipy()
        return

    def load_additional_registries(self):
        _arraymath_without_scipy()
        return real(self)

    cpu.CPUContext.load_additional_registries = load_additional_registries


_registries_when_compiling()


def _plain_error_markup() -> None:
    """Format numba's typing errors without colorama's stream wrapping.

    Typing a kernel tries many overload templates and builds an error message
    for each one that does not match (about 37,000 on a first start); each
    message's markup wraps and unwraps ``sys.stdout``/``sys.stderr`` with
    colorama (``errors.ColorShell``), about 0.45 CPU s of a first start's
    compile.  The markup is built in a byte buffer and never written to those
    streams, so a no-op shell gives the same messages.
    """
    from numba.core import errors  # lazy: numba internals, on numba's schedule

    if getattr(errors, "ColorShell", None) is None:   # another numba, or no colorama: nothing to skip
        return

    class _NoShell:
        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return None

    errors.ColorShell = _NoShell


_plain_error_markup()


def _quiet_llvm_lock() -> None:
    """Drop numba's ``numba:llvm_lock`` event callbacks.

    numba broadcasts an event each time it takes llvmlite's lock (every LLVM
    call: about 38,000 on a first start) so that each compile can time its
    LLVM share for ``metadata["timers"]``, which nothing here reads; the
    broadcasts cost about 0.6 CPU s of a first start's compile.
    """
    import llvmlite.binding.ffi as ffi  # lazy: numba internals, on numba's schedule

    lock = getattr(getattr(ffi, "lib", None), "_lock", None)
    callbacks = getattr(lock, "_cblist", None)
    if not isinstance(callbacks, list):     # another llvmlite: leave it alone
        return
    callbacks[:] = [(acq, rel) for acq, rel in callbacks
                    if getattr(acq, "__qualname__", "") != "_initialize_llvm_lock_event.<locals>.enter_fn"]


def _fast_target_config_compare() -> None:
    """Make numba's ``TargetConfig`` hashing and comparison cheap, with the same results.

    Typing looks up every overload template's cache by the current compile
    flags (about 30,000 lookups on a first start), and each ``__hash__`` and
    ``__eq__`` built a dict of all 40-odd options through their properties:
    about 1 CPU s.  The hash numba computes is that of the sorted option
    *names* (``sorted`` of the values dict sorts its keys), the same for
    every instance of a class, so it is kept per class; two configs of one
    class are compared option by option as their properties read them (the
    set value, else the option's default), without the properties and dicts.
    """
    from numba.core import targetconfig  # lazy: numba internals, on numba's schedule

    cls = getattr(targetconfig, "TargetConfig", None)
    if cls is None or "__hash__" not in cls.__dict__ or not hasattr(cls, "values"):
        return
    probe = cls()
    if not isinstance(getattr(probe, "_values", None), dict):   # another numba: leave it alone
        return
    full_eq = cls.__eq__
    hashes: dict = {}

    def __hash__(self):
        kind = type(self)
        h = hashes.get(kind)
        if h is None:
            h = hashes[kind] = hash(tuple(sorted(self.values())))
        return h

    def __eq__(self, other):
        if type(other) is not type(self):
            return full_eq(self, other)
        mine, theirs = self._values, other._values
        if mine == theirs:
            return True
        for name, option in type(self).options.items():
            a = mine.get(name, option.default)
            b = theirs.get(name, option.default)
            if a is not b and a != b:
                return False
        return True

    cls.__hash__ = __hash__
    cls.__eq__ = __eq__


if not numba.config.DISABLE_JIT:
    _quiet_llvm_lock()
    _fast_target_config_compare()

# ``no_cfunc_wrapper``: numba otherwise compiles a C-callable wrapper of every
# kernel (for first-class function use, which no kernel makes: ``call_at``
# calls the native entry point), about 0.8 CPU s of a first start plus its LLVM
JIT = dict(cache=True, nogil=True, boundscheck=False, no_cfunc_wrapper=True)

# ``{id(dispatcher): wait}``: called once, before a kernel's call to that
# dispatcher is typed (``warm.py``: the first start's other process compiles it
# into the on-disk cache; numba then loads it from there instead of compiling it
# a second time here)
BEFORE_TYPING: dict = {}

class _Dispatcher(_CPUDispatcher):
    """numba's dispatcher, except that a call from another kernel compiles one
    specialization per argument *type*, not per constant value.

    numba types a constant argument (``f(x, 0)``, ``f(a, True)``) as a literal
    and compiles the callee again for each value: the sweep's kernels had 27
    such extra specializations (``cmp_tuple_nb(.., -1)``, ``_tournament_cmp(..,
    True)``, ...), each a full compile.  A kernel's result never depends on
    being specialized (LLVM still propagates the constant when it inlines the
    callee); only compile time does.
    """

    def get_call_template(self, args, kws):
        if BEFORE_TYPING:
            wait = BEFORE_TYPING.pop(id(self), None)
            if wait is not None:
                wait()
        return super().get_call_template(tuple(_types.unliteral(a) for a in args),
                                         {k: _types.unliteral(v) for k, v in kws.items()})


class _CacheLoadsOnly(_FunctionCache):
    """numba's on-disk cache of one kernel, except that loading a kernel from it
    does not first fill numba's typing and lowering registries.

    numba refreshes its whole compile context before every cache load, and the
    first refresh imports and registers every built-in implementation (lists,
    sets, ``np.random``, cffi, ...): about 0.2 s of the sample sweep's 1.9 s
    cached start, though loading compiled code needs none of them.  It needs
    numba's runtime (the allocator's symbols, which the cached code calls), so
    that is initialised here; a kernel that does compile still gets the
    refresh, from numba's compiler, before it is typed.
    """

    def load_overload(self, sig, target_context):
        # a cached kernel that used one of numba's numpy implementations imports
        # the module holding it as it loads: ``numba.np.arraymath``, whose import
        # is made without the BLAS probe
        _arraymath_without_scipy()
        _rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)


def _loads_only(dispatcher) -> None:
    cache = getattr(dispatcher, "_cache", None)
    if type(cache) is _FunctionCache and hasattr(cache, "_load_overload") \
            and hasattr(cache, "_guard_against_spurious_io_errors"):   # else another numba: keep its cache
        cache.__class__ = _CacheLoadsOnly


# ``{name: numba Signature}``: what each :func:`call_at` call site was typed
# with in this process (``warm.py`` compiles the callee for it)
CALL_AT_TYPED: dict = {}


def fingerprint(sig) -> int:
    """A number naming a kernel signature (its argument and return types)."""
    return zlib.crc32(str(sig).encode())


def call_at(name: str, callee, restype):
    """``f(link, args)``: call the compiled kernel ``callee`` through the
    address ``link[0]`` instead of linking it into the calling kernel.

    numba links every kernel a kernel calls into the caller's LLVM module and
    optimises and compiles that module as a whole, so the grid kernel's own
    compile re-did its whole call tree (about 5 CPU s on a first start, after
    every helper was ready).  Called through an address, the caller's module
    holds only its own code: the caller and ``callee`` compile independently,
    and at the same time in two processes (``warm.py``).  ``args`` is a tuple
    of ``callee``'s arguments; ``link`` an int64 array: the address of
    ``callee``'s native entry point compiled for exactly those argument types
    and ``restype`` (``warm.link``), then :func:`fingerprint` of that
    signature, which the call checks (a mismatch raises instead of calling
    with the wrong layout).  Without the jit it is a plain call.
    """
    if numba.config.DISABLE_JIT:
        def plain(link, args):
            return callee(*args)
        return plain

    def typer(typingctx, link, args):
        argtys = tuple(_types.unliteral(a) for a in args.types)
        target = restype(*argtys)
        CALL_AT_TYPED[name] = target
        expect = fingerprint(target)

        def codegen(context, builder, sig, llargs):
            ary = context.make_array(sig.args[0])(context, builder, llargs[0])
            addr = builder.load(ary.data)
            got = builder.load(builder.gep(ary.data, [_ir.Constant(_ir.IntType(64), 1)]))
            with builder.if_then(builder.icmp_unsigned("!=", got, _ir.Constant(got.type, expect)),
                                 likely=False):
                context.call_conv.return_user_exc(
                    builder, RuntimeError, (f"{name}: the linked kernel was compiled for another signature",))
            packed = sig.args[1]
            values = [context.cast(builder, builder.extract_value(llargs[1], i), packed.types[i], argtys[i])
                      for i in range(len(argtys))]
            fnty = context.call_conv.get_function_type(restype, argtys)
            fn = builder.inttoptr(addr, fnty.as_pointer())
            status, res = context.call_conv.call_function(builder, fn, restype, argtys, values)
            with _cgutils.if_unlikely(builder, status.is_error):
                context.call_conv.return_status_propagate(builder, status)
            return res

        return restype(link, args), codegen

    typer.__name__ = f"call_{name}"
    return _intrinsic(typer)


def _address_of(typingctx, value):
    if not isinstance(value, _types.BaseTuple) or not all(isinstance(t, _types.Array) for t in value):
        return None     # a tuple of arrays only: its layout in memory is its value's (no booleans)

    def codegen(context, builder, sig, args):
        return _cgutils.alloca_once_value(builder, args[0])

    return _types.CPointer(value)(value), codegen


if numba.config.DISABLE_JIT:
    def address_of(value):
        """A one-element box of ``value`` (what ``[0]`` reads, as the compiled one)."""
        return (value,)
else:
    address_of = _intrinsic(_address_of)
    address_of.__doc__ = """``address_of(t)``: the address of a copy of ``t`` (a tuple of arrays) in
    the calling kernel's frame, as a ``CPointer``; ``p[0]`` reads it back.

    A kernel passes a tuple of arrays through its address when it calls another
    many times with the same tuple: a tuple of 21 arrays passed by value is
    about 165 machine words stored for every call (numba flattens arguments),
    through its address one.  Make the address once, before the loop (the copy
    lives as long as the calling kernel's frame), and only in a kernel that
    does not count references (``allocates=False``): the copy holds no
    reference of its own."""


def _popcount(typingctx, x):
    if not isinstance(x, _types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.ctpop(args[0])

    return x(x), codegen


def _trailing_zeros(typingctx, x):
    if not isinstance(x, _types.Integer):
        return None

    def codegen(context, builder, sig, args):
        return builder.cttz(args[0], _ir.Constant(_ir.IntType(1), 0))

    return x(x), codegen


_BITS64 = (1 << 64) - 1

if numba.config.DISABLE_JIT:
    def popcount(x):
        """The number of set bits of the 64-bit integer ``x`` (two's complement)."""
        return (int(x) & _BITS64).bit_count()

    def trailing_zeros(x):
        """The position of the lowest set bit of the 64-bit integer ``x`` (64 for 0)."""
        v = int(x) & _BITS64
        return (v & -v).bit_length() - 1 if v else 64
else:
    popcount = _intrinsic(_popcount)
    popcount.__doc__ = """``popcount(x)``: the set bits of an integer, one machine instruction
    (LLVM's ``ctpop``) where the CPU has one."""
    trailing_zeros = _intrinsic(_trailing_zeros)
    trailing_zeros.__doc__ = """``trailing_zeros(x)``: the position of the lowest set bit of an
    integer, its width for 0 (LLVM's ``cttz``)."""


def link_to(dispatcher, args: tuple):
    """A :func:`call_at` link (int64 ``[address, fingerprint]``) to ``dispatcher``
    compiled (or loaded from the cache) for the argument types ``args``."""

    dispatcher.compile(args)
    cres = dispatcher.overloads[tuple(args)]
    addr = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
    if not addr:
        raise RuntimeError(f"{dispatcher.py_func.__name__}: no native entry point after its compile")
    return np.array([addr, fingerprint(cres.signature)], dtype=np.int64)


def _options(allocates: bool) -> dict:
    """numba's options for a kernel; ``allocates=False`` compiles it without
    numba's reference counting (NRT).

    With NRT, a kernel counts a reference (an atomic add, then an atomic
    subtract) for every array it takes, every array inside a named-tuple
    argument and every view it makes, on every call.  The grid pass's hot
    kernels take named tuples of 10 to 21 arrays and make views per request,
    and LLVM removes few of those pairs across a call: the counting was about
    45% of the 152-config grid's time (benches/README.md, second speed round).  A kernel
    that allocates no array and returns none needs no counting: every array it
    sees belongs to its caller, which outlives the call.  Such a kernel is
    marked ``allocates=False``; one that does allocate (``np.zeros`` ...) then
    fails to compile instead of running wrong.  Mark a kernel only when
    neither it nor anything it calls allocates or returns an array: a kernel
    it calls that is typed while it compiles inherits the setting.
    """
    return JIT if allocates else {**JIT, "_nrt": False}


def _kernel(fn, kind: type, allocates: bool, **extra):
    """``fn`` compiled by ``numba.njit`` with :func:`_options` and ``extra``, as a
    ``kind`` dispatcher whose cache loads only (:class:`_CacheLoadsOnly`)."""
    dispatcher = numba.njit(**extra, **_options(allocates))(fn)
    if isinstance(dispatcher, _CPUDispatcher):   # not under NUMBA_DISABLE_JIT=1 (the plain-Python runs)
        dispatcher.__class__ = kind
        _loads_only(dispatcher)
    return dispatcher


def njit(fn=None, *, allocates: bool = True, inline: bool = False):
    """``numba.njit`` with the options above and :class:`_Dispatcher`
    (``@njit`` or ``@njit(allocates=False)``, see :func:`_options`).

    ``inline=True`` (numba's ``forceinline``): LLVM always inlines the kernel
    into the kernels that call it.  LLVM's own heuristic leaves the decision
    helpers of a few hundred instructions as calls, and numba passes every
    array as seven to nine machine words, most of them on the stack: the
    grid pass's sampler made about seven such calls per domain-rung
    evaluation.  Meant for helpers with one or two call sites:
    each call site compiles its own copy."""
    if fn is None:
        return lambda f: njit(f, allocates=allocates, inline=inline)
    return _kernel(fn, _Dispatcher, allocates, forceinline=inline)


class _InnerDispatcher(_Dispatcher):
    """A kernel compiled without the wrappers that let Python call it: only
    other kernels call it.  A Python call is a TypeError (numba would call a
    missing wrapper and crash), so no overload goes into the table Python
    calls are matched against."""

    def add_overload(self, cres):
        self.overloads[tuple(cres.signature.args)] = cres

    def _compile_for_args(self, *args, **kws):
        raise TypeError(f"{self.py_func.__name__} is compiled for calls from other kernels only "
                        "(replay/kernels/_jit.py: njit_inner)")


def njit_inner(fn=None, *, allocates: bool = True):
    """``njit`` for a kernel that only other kernels call: numba generates no
    Python or C-callable wrapper for it (the largest helpers take named tuples
    of a dozen arrays, whose unboxing code was compiled and optimised for
    nothing).  ``allocates`` as for :func:`njit`."""
    if fn is None:
        return lambda f: njit_inner(f, allocates=allocates)
    return _kernel(fn, _InnerDispatcher, allocates, no_cpython_wrapper=True)
