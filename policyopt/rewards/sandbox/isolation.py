"""Assert tests outside the program's process: the code verifier's ``isolation="process"``.

The program and its tests run in two sandboxed processes joined by two pipes. The
*server* (:func:`serve`) runs the untrusted program, then answers requests (call this,
get this attribute, iterate this); the *client* (:func:`run_tests`) runs the trusted
tests with a stand-in for each name the program defined, and writes the scorer's marker
when they have run to their end. Only plain values cross, as tagged JSON (:func:`encode`,
:func:`decode`). What this stops and what honest programs lose: ``docs/rewards.md``
("Isolated assert tests"). This file runs in the sandbox's interpreter (``python -I -S``:
the standard library only); ``policyopt.rewards.sandbox.run`` sends its source followed
by one call to :func:`serve` or :func:`run_tests`.
"""

import builtins
import json
import os
import struct
import sys

MAX_MESSAGE_BYTES = 1 << 26
_HEADER = struct.Struct(">I")
_SMALL_INT = 1 << 62


class ProtocolError(BaseException):
    """The server broke the protocol (died, sent something not in it): the tests fail.
    A ``BaseException`` so that a test's ``except Exception`` cannot swallow it; the
    client also remembers it and refuses to pass (a bare ``except:``)."""


class ProgramError(Exception):
    """An exception of the program's whose type is not a built-in one."""


def _send(fd, message):
    data = json.dumps(message, separators=(",", ":")).encode("ascii")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view) :]


def _read_exact(fd, size):
    chunks, left = [], size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("pipe closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(fd):
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if size > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {size} bytes")
    return json.loads(_read_exact(fd, size).decode("ascii"))


# ---- The codec ---------------------------------------------------------------------------
# A value is a JSON scalar (null, true/false, a number, a string) or a list whose first
# item is a tag. Floats keep their type (json writes 2.0 as 2.0, and NaN / Infinity);
# ints beyond 2**62 travel as hex text (no digit limit).


def _mapping(tag, items, inner):
    flat = [tag]
    for key, value in items:
        flat.append(inner(key))
        flat.append(inner(value))
    return flat


def encode(value, unknown):
    """``value`` as JSON data; ``unknown(value)`` encodes what is not plain (a handle, or
    an error)."""

    def inner(item):
        return encode(item, unknown)

    kind = type(value)
    if value is None or kind is bool or kind is str or kind is float:
        return value
    if kind is int:
        return value if -_SMALL_INT < value < _SMALL_INT else ["I", format(value, "x")]
    if kind is list:
        return ["L"] + [inner(item) for item in value]
    if kind is tuple:
        return ["T"] + [inner(item) for item in value]
    if kind is dict:
        return _mapping("D", value.items(), inner)
    if kind is set or kind is frozenset:
        return ["S" if kind is set else "F"] + [inner(item) for item in value]
    if kind is bytes or kind is bytearray:
        return ["B" if kind is bytes else "A", value.hex()]
    if kind is complex:
        return ["C", value.real, value.imag]
    if kind is range:
        return ["R", inner(value.start), inner(value.stop), inner(value.step)]
    if value is Ellipsis:
        return ["E"]
    module, name = getattr(kind, "__module__", ""), getattr(kind, "__qualname__", "")
    if module == "fractions" and name == "Fraction":
        return ["Q", inner(value.numerator), inner(value.denominator)]
    if module == "decimal" and name == "Decimal":
        return ["M", str(value)]
    if module == "collections":
        if name == "Counter":
            return _mapping("K", dict.items(value), inner)
        if name == "OrderedDict":
            return _mapping("O", dict.items(value), inner)
        if name == "defaultdict":
            return _mapping("X", dict.items(value), inner)
        if name == "deque":
            return ["Y"] + [inner(item) for item in value]
    return unknown(value)


def _base_value(value):
    """A subclass of a built-in (a namedtuple, an IntEnum, a str subclass) as its base
    type's value, or None when ``value`` is not one."""
    for base in (
        bool,
        int,
        float,
        complex,
        str,
        bytes,
        bytearray,
        tuple,
        list,
        frozenset,
        set,
        dict,
    ):
        if isinstance(value, base):
            return base(value)
    return None


def decode(data, handle):
    """A value from its JSON data, built from this process's own classes;
    ``handle(id, type name)`` makes the object for a handle. Raises ``ProtocolError``
    on anything that is not the codec's output."""
    try:
        return _decode(data, handle)
    except ProtocolError:
        raise
    except (
        TypeError,
        ValueError,
        KeyError,
        IndexError,
        OverflowError,
        RecursionError,
        ArithmeticError,
    ) as error:
        raise ProtocolError(f"undecodable value ({type(error).__name__}: {error})") from None


def _pairs(items, inner):
    if len(items) % 2:
        raise ProtocolError("a mapping with an odd number of items")
    return [(inner(items[i]), inner(items[i + 1])) for i in range(0, len(items), 2)]


def _decode(data, handle):
    kind = type(data)
    if data is None or kind is bool or kind is str or kind is float or kind is int:
        return data
    if kind is not list or not data or type(data[0]) is not str:
        raise ProtocolError(f"not a value: {kind.__name__}")

    def inner(item):
        return _decode(item, handle)

    tag, items = data[0], data[1:]
    if tag == "L":
        return [inner(item) for item in items]
    if tag == "T":
        return tuple(inner(item) for item in items)
    if tag == "D":
        return dict(_pairs(items, inner))
    if tag == "S":
        return set(inner(item) for item in items)
    if tag == "F":
        return frozenset(inner(item) for item in items)
    if tag == "I" and len(items) == 1 and type(items[0]) is str:
        return int(items[0], 16)
    if tag in ("B", "A") and len(items) == 1 and type(items[0]) is str:
        return (bytes if tag == "B" else bytearray).fromhex(items[0])
    if tag == "C" and len(items) == 2 and all(type(x) in (int, float) for x in items):
        return complex(items[0], items[1])
    if tag == "R" and len(items) == 3:
        bounds = [inner(item) for item in items]
        if not all(type(x) is int for x in bounds):
            raise ProtocolError("range bounds must be ints")
        return range(*bounds)
    if tag == "E" and not items:
        return Ellipsis
    if tag == "Q" and len(items) == 2:
        import fractions

        numerator, denominator = inner(items[0]), inner(items[1])
        if type(numerator) is not int or type(denominator) is not int:
            raise ProtocolError("a Fraction's terms must be ints")
        return fractions.Fraction(numerator, denominator)
    if tag == "M" and len(items) == 1 and type(items[0]) is str:
        import decimal

        return decimal.Decimal(items[0])
    if tag in ("K", "O", "X"):
        import collections

        pairs = _pairs(items, inner)
        if tag == "K":
            return collections.Counter(dict(pairs))
        if tag == "O":
            return collections.OrderedDict(pairs)
        return collections.defaultdict(None, pairs)
    if tag == "Y":
        import collections

        return collections.deque(inner(item) for item in items)
    if tag == "H" and len(items) == 2 and type(items[0]) is int and type(items[1]) is str:
        return handle(items[0], items[1])
    if tag == "Z" and len(items) == 2 and type(items[0]) is str and type(items[1]) is str:
        return _program_exception(items[0], items[1])
    raise ProtocolError(f"unknown tag {tag!r}")


# ---- The server: runs the program ---------------------------------------------------------

_MUTABLE = (list, dict, set, bytearray)


def serve(program, requests, replies):
    """Runs ``program`` (its own ``SystemExit`` caught), sends the names it defined, then
    answers requests until the client closes its end."""
    handles, keys = {}, {}  # one key per object, kept alive: the tests' `is` works

    def as_handle(value):
        base = _base_value(value)
        if base is not None:
            return encode(base, as_handle)
        if type(value) is type(sys) and getattr(value, "__name__", None) in _stdlib_modules():
            return ["U", value.__name__]  # the client imports its own copy
        if isinstance(value, type) and issubclass(value, BaseException):
            return ["Z", value.__qualname__, _builtin_base(value)]  # the client makes its own
        key = keys.get(id(value))
        if key is None:
            key = keys[id(value)] = len(handles)
            handles[key] = value
        return ["H", key, type(value).__qualname__]

    def local(key, name):
        if key not in handles:
            raise KeyError(f"no object {key}")
        return handles[key]

    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(program, "program.py", "exec"), namespace)
    except SystemExit:
        pass
    except BaseException as error:  # the tests would fail on the first name they use
        _send(replies, {"load_error": _describe(error, as_handle)[:2]})
        return
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__") or not name.isidentifier():
            continue
        try:
            names[name] = encode(value, as_handle)
        except (RecursionError, ValueError, TypeError):
            continue
    _send(replies, {"names": names})
    while True:
        try:
            request = _recv(requests)
        except (EOFError, OSError):
            return
        _send(replies, _answer(request, handles, as_handle, local))


def _builtin_base(kind):
    """The name of the first built-in exception class in ``kind``'s method resolution order."""
    for base in kind.__mro__:
        if getattr(builtins, base.__name__, None) is base:
            return base.__name__
    return "Exception"


def _describe(error, as_handle):
    """``[type name, message, built-in base name, args (encoded) or None]``."""
    try:
        message = str(error)[:2000]
    except BaseException:
        message = "<unprintable>"
    try:
        args = encode(tuple(error.args), as_handle)
    except BaseException:
        args = None
    return [type(error).__name__, message, _builtin_base(type(error)), args]


def _answer(request, handles, as_handle, local):
    try:
        op = request["op"]
        target = local(request["h"], "")
        if op == "call":
            args = [decode(a, local) for a in request["a"]]
            kwargs = {key: decode(v, local) for key, v in request["k"].items()}
            value = target(*args, **kwargs)
            back = [encode(a, as_handle) if type(a) in _MUTABLE else None for a in args]
            back_kw = {
                key: encode(v, as_handle) for key, v in kwargs.items() if type(v) in _MUTABLE
            }
            return {"v": encode(value, as_handle), "a": back, "k": back_kw}
        if op == "next":  # up to n items: one round trip for many
            items = []
            for _ in range(request["n"]):
                try:
                    items.append(next(target))
                except StopIteration:
                    return {"v": encode(items, as_handle), "done": True}
                except BaseException as error:  # raised after the items before it
                    return {
                        "v": encode(items, as_handle),
                        "done": True,
                        "then": _describe(error, as_handle),
                    }
            return {"v": encode(items, as_handle), "done": False}
        if op == "getattr":
            value = getattr(target, request["n"])
        elif op == "setattr":
            setattr(target, request["n"], decode(request["x"], local))
            value = None
        elif op == "iter":
            value = iter(target)
        elif op == "bool":
            value = bool(target)
        elif op == "len":
            value = len(target)
        elif op == "getitem":
            value = target[decode(request["x"], local)]
        elif op == "contains":
            value = decode(request["x"], local) in target
        elif op == "str":
            value = str(target)
        elif op == "repr":
            value = repr(target)
        else:
            raise ValueError(f"unknown op {op!r}")
        return {"v": encode(value, as_handle)}
    except BaseException as error:  # the program's exceptions, SystemExit included
        return {"e": _describe(error, as_handle)}


def _stdlib_modules():
    return getattr(sys, "stdlib_module_names", ())


# ---- The client: runs the tests -----------------------------------------------------------


class _Connection:
    def __init__(self, replies, requests):
        self.replies, self.requests, self.broken = replies, requests, None

    def receive(self):
        try:
            message = _recv(self.replies)
        except ProtocolError as error:
            self.broken = str(error)
            raise
        except (EOFError, OSError, ValueError, struct.error, RecursionError, MemoryError) as error:
            self.broken = (
                f"the program's process is gone or garbled ({type(error).__name__}: {error})"
            )
            raise ProtocolError(self.broken) from None
        if type(message) is not dict:
            self.broken = "a reply that is not an object"
            raise ProtocolError(self.broken)
        return message

    def value(self, data):
        try:
            return decode(data, _Remote)
        except ProtocolError as error:
            self.broken = str(error)
            raise

    def request(self, op, remote, **fields):
        if self.broken:
            raise ProtocolError(self.broken)
        fields.update(op=op, h=remote._key)
        try:
            _send(self.requests, fields)
        except OSError as error:
            self.broken = f"the program's process is gone ({error})"
            raise ProtocolError(self.broken) from None
        reply = self.receive()
        if "e" in reply:
            raise self.error(reply["e"])
        if "v" not in reply:
            self.broken = "a reply without a value"
            raise ProtocolError(self.broken)
        return reply

    def error(self, error):
        """The exception for an error reply ``[name, message, base, args]``."""
        if type(error) is not list or len(error) != 4 or not all(type(x) is str for x in error[:3]):
            self.broken = "a malformed error"
            raise ProtocolError(self.broken)
        args = None if error[3] is None else self.value(error[3])
        return _exception(error[0], error[1], error[2], args if type(args) is tuple else None)

    def call(self, remote, args, kwargs):
        reply = self.request(
            "call",
            remote,
            a=[_outgoing(a) for a in args],
            k={key: _outgoing(v) for key, v in kwargs.items()},
        )
        value = self.value(reply["v"])
        back, back_kw = reply.get("a"), reply.get("k")
        if type(back) is not list or len(back) != len(args) or type(back_kw) is not dict:
            self.broken = "a call reply without its arguments"
            raise ProtocolError(self.broken)
        for original, data in list(zip(args, back)) + [
            (kwargs.get(k), v) for k, v in back_kw.items()
        ]:
            if data is not None and type(original) in _MUTABLE:
                _write_back(original, self.value(data))
        return value


_CONNECTION = None


_EXCEPTIONS = {}


def _program_exception(name, base):
    """The tests' class for the program's exception class ``name``: a subclass of the
    built-in ``base`` it derives from (``except ValueError`` catches the program's
    ``class BadInput(ValueError)``, and ``except BadInput`` names this class), and of
    :class:`ProgramError` when that base is ``Exception`` itself."""
    kind = getattr(builtins, base, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = Exception
    if (name, kind) not in _EXCEPTIONS:
        bases = (ProgramError,) if kind is Exception else (kind,)
        _EXCEPTIONS[name, kind] = type(name if name.isidentifier() else "ProgramError", bases, {})
    return _EXCEPTIONS[name, kind]


def _exception(name, message, base="Exception", args=None):
    """The exception the tests see: the built-in one of that name (only ``Exception``
    subclasses: a ``SystemExit`` from the program is a :class:`ProgramError`), else the
    program's class as :func:`_program_exception` makes it; with the program's ``args``
    where they are plain values."""
    kind = getattr(builtins, name, None)
    if not (isinstance(kind, type) and issubclass(kind, Exception)):
        kind = _program_exception(name, base)
    for make in ((lambda: kind(*args)) if args is not None else None, lambda: kind(message)):
        if make is not None:
            try:
                return make()
            except Exception:  # a constructor that wants other arguments (UnicodeDecodeError)
                pass
    return _program_exception(name, "Exception")(message)


def _write_back(original, updated):
    """Copies a mutated argument back into the tests' object, keeping its identity."""
    if type(updated) is not type(original):
        return
    if type(original) in (list, bytearray):
        original[:] = updated
    else:
        original.clear()
        original.update(updated)


def _outgoing(value):
    def unknown(item):
        if type(item) is _Remote:
            return ["H", item._key, item._name]
        if isinstance(item, tuple):  # a namedtuple
            return encode(tuple(item), unknown)
        raise TypeError(
            f"isolated tests pass plain values to the program, not {type(item).__name__}"
        )

    return encode(value, unknown)


def _refuse(operation):
    def method(self, *args):
        raise TypeError(
            f"{operation} of the program's {self._name} object: isolated tests compare "
            "plain values (lists, numbers, strings, ...), not the program's objects"
        )

    return method


class _Remote:
    """The tests' stand-in for one of the program's objects (functions, classes,
    instances, iterators): calls, attribute reads and writes, iteration, ``len``,
    indexing, ``in``, truth, ``str`` and ``repr`` are forwarded, and answered by the
    program with plain values (none of these lets an object pass more than a plain value
    could: a program may return ``True``, or ``range(-10**18, 10**18)`` for ``in``).
    ``==``, ``!=`` and ordering are refused (an object equal to everything would pass
    every comparison; nothing plain does); hashing and ``is`` go by identity (one
    stand-in per object of the program's)."""

    __slots__ = ("_key", "_name", "_items", "_batch", "_then")

    def __new__(cls, key, name):
        remote = _REMOTES.get(key)
        if remote is None:
            remote = _REMOTES[key] = object.__new__(cls)
            object.__setattr__(remote, "_key", key)
            object.__setattr__(remote, "_name", name)
            object.__setattr__(remote, "_items", [])
            object.__setattr__(remote, "_batch", 0)
            object.__setattr__(remote, "_then", None)
        return remote

    def __call__(self, *args, **kwargs):
        return _CONNECTION.call(self, args, kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _CONNECTION.value(_CONNECTION.request("getattr", self, n=name)["v"])

    def _plain(self, op, kind, **fields):
        value = _CONNECTION.value(_CONNECTION.request(op, self, **fields)["v"])
        if type(value) is not kind:
            raise TypeError(f"{op} of the program's {self._name} gave {type(value).__name__}")
        return value

    def __setattr__(self, name, value):
        _CONNECTION.request("setattr", self, n=name, x=_outgoing(value))

    def __iter__(self):
        return _CONNECTION.value(_CONNECTION.request("iter", self)["v"])

    def __next__(self):
        if not self._items:
            if self._then is not None:  # the program's iterator raised after its last items
                error = self._then
                object.__setattr__(self, "_then", None)
                raise _CONNECTION.error(error)
            if self._batch < 0:  # the program's iterator ended
                raise StopIteration
            # 1, 2, 4, ... 1024 items per round trip: a long generator costs few round
            # trips, a slow one is not run far ahead of what the tests take.
            batch = min(2 * self._batch or 1, 1024)
            reply = _CONNECTION.request("next", self, n=batch)
            items = _CONNECTION.value(reply["v"])
            if type(items) is not list or len(items) > batch:
                _CONNECTION.broken = "a malformed batch of items"
                raise ProtocolError(_CONNECTION.broken)
            self._items.extend(reversed(items))
            object.__setattr__(self, "_batch", -1 if reply.get("done") is True else batch)
            object.__setattr__(self, "_then", reply.get("then"))
            if not self._items:
                return self.__next__()
        return self._items.pop()

    def __bool__(self):
        return self._plain("bool", bool)

    def __hash__(self):
        return object.__hash__(self)

    def __len__(self):
        return self._plain("len", int)

    def __getitem__(self, key):
        return _CONNECTION.value(_CONNECTION.request("getitem", self, x=_outgoing(key))["v"])

    def __contains__(self, item):
        return self._plain("contains", bool, x=_outgoing(item))

    def __str__(self):
        return self._plain("str", str)

    def __repr__(self):
        return self._plain("repr", str)

    __eq__ = _refuse("==")
    __ne__ = _refuse("!=")
    __lt__ = _refuse("<")
    __le__ = _refuse("<=")
    __gt__ = _refuse(">")
    __ge__ = _refuse(">=")


_REMOTES = {}


def run_tests(tests, marker, replies, requests):
    """Waits for the program's names, runs ``tests`` with them, then writes ``marker`` on a
    line of its own to stdout (only when the tests ran to their end and the program's
    process kept to the protocol)."""
    global _CONNECTION
    _CONNECTION = connection = _Connection(replies, requests)
    hello = connection.receive()
    if "load_error" in hello:
        name, message = hello["load_error"] if type(hello["load_error"]) is list else ("?", "?")
        raise SystemExit(f"the program failed before the tests: {name}: {message}")
    names = hello.get("names")
    if type(names) is not dict:
        raise ProtocolError("no names from the program")
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    shadowed, modules = set(dir(builtins)), set(_stdlib_modules())
    # Names the tests use as modules (`math.isclose`): a program's `math = FakeMath()`
    # must not answer them, so those that name standard-library modules get the module.
    import ast

    dotted = {
        node.value.id
        for node in ast.walk(ast.parse(tests))
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
    }
    for name in dotted & modules:
        try:
            namespace[name] = __import__(name)
        except ImportError:
            pass
    for name, data in names.items():
        if type(name) is not str or not name.isidentifier() or name in shadowed:
            continue
        is_module = (
            type(data) is list and len(data) == 2 and data[0] == "U" and type(data[1]) is str
        )
        if is_module:
            if data[1] in modules:
                try:
                    namespace[name] = __import__(data[1], fromlist=["_"])
                except ImportError:
                    pass
            continue
        if name in namespace:
            continue
        try:
            namespace[name] = decode(data, _Remote)
        except ProtocolError:
            continue  # a name the tests need is missing: they fail on it
    exec(compile(tests, "tests.py", "exec"), namespace)
    if connection.broken:
        raise SystemExit(f"the program's process broke the protocol: {connection.broken}")
    sys.stdout.flush()
    os.write(1, ("\n" + marker + "\n").encode())
