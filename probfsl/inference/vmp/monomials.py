"""Monomials in latent positive sites, traced through the model: how the compiler reads the
coefficient c of a precision or rate c · Π_k τ_k structurally.

A Gamma parent is conjugate to a Normal precision, or to a Gamma or Poisson rate, when that
parameter is c times the parent, or times a product of Gamma parents (Winn & Bishop 2005,
Table 1; VMP design §7.4 for the scale mixtures). The compiler's first run of the model gives
each latent Gamma site a :class:`Monomial` value: a tensor that carries its own symbolic
form K · Π_s τ_s^(e_s), with fractional exponents e_s and K a product of constants (numbers
and tensors), each with its own fractional exponent. Arithmetic that keeps a monomial a
monomial (products and quotients with constants or with other monomials, powers by a
number, square roots, reciprocals) and operations that only move values (views, indexing,
broadcasting, dtype changes) carry the form along; every other operation returns a plain
tensor. A scale written ``(c * tau) ** -0.5`` is read back as the precision c¹ · τ¹, and c
is the model's own tensor, bit for bit: nothing read off the model is rounded.

The logarithm of a monomial is a :class:`Logarithm`, ln K + Σ_s e_s ln τ_s, which keeps
its form through products with a number, negation, sums and differences of logarithms and
the same moves; its exponential is a monomial again, so a scale written
``exp(-0.5 * log(tau))`` is read as τ^(-1/2). A logarithm meets nothing else: its product
with a monomial, or a constant added to it, returns a plain tensor.

A form may also carry *origins*: integer codes of the entries of a site's value, moved
with them. The compiler codes a parent's entries by component and reads off which
component each entry of a parameter copies: the fixed index of a mixture whose labels
are data (``Vindex(mu)[..., y]``, or ``one_hot(y) @ mu``, a product with one-hot rows).

What the form cannot see, a constant that in fact depends on another latent site, the
compiler's verifying run (other values of every latent site) rules out.
"""

from __future__ import annotations

from fractions import Fraction
from numbers import Real

import torch

#: operations that move values without changing them: applied alike to each tensor factor
#: of K (held in the value's shape, so every index and view means the same for them)
_MOVES = {
    getattr(torch.Tensor, name)
    for name in (
        "__getitem__",
        "clone",
        "contiguous",
        "double",
        "expand",
        "expand_as",
        "flatten",
        "float",
        "movedim",
        "narrow",
        "permute",
        "reshape",
        "select",
        "squeeze",
        "to",
        "transpose",
        "unsqueeze",
        "view",
    )
} | {torch.broadcast_to, torch.movedim, torch.permute, torch.reshape, torch.squeeze}
_MOVES |= {torch.transpose, torch.unsqueeze, torch.Tensor.broadcast_to}

#: the moves that change a tensor's dtype (not applied to the integer origins)
_RETYPES = {torch.Tensor.to, torch.Tensor.double, torch.Tensor.float}

#: x ** q for a fixed q
_POWERS = {
    torch.sqrt: Fraction(1, 2),
    torch.Tensor.sqrt: Fraction(1, 2),
    torch.rsqrt: Fraction(-1, 2),
    torch.Tensor.rsqrt: Fraction(-1, 2),
    torch.reciprocal: Fraction(-1),
    torch.Tensor.reciprocal: Fraction(-1),
}
_POW = {torch.pow, torch.Tensor.pow, torch.Tensor.__pow__}
_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__}
_RDIV = {torch.Tensor.__rtruediv__}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__}
_LOG = {torch.log, torch.Tensor.log}
_EXP = {torch.exp, torch.Tensor.exp}
_NEG = {torch.neg, torch.Tensor.neg, torch.Tensor.__neg__}
_ADD = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_SUB = {torch.sub, torch.Tensor.sub, torch.Tensor.__sub__}
#: a pseudo-site marking a monomial changed in place (its form no longer holds)
_CHANGED = "#changed in place"


class _Form(torch.Tensor):
    """A tensor that carries the form K · Π_s τ_s^(e_s) (:class:`Monomial`: the tensor is
    that product; :class:`Logarithm`: its logarithm). ``powers`` maps each latent site s
    (by its Pyro name) to e_s, ``factors`` holds K as ``(constant, exponent)`` pairs, each
    constant a Python number or a tensor of this tensor's shape; ``origins`` may map a site
    to an integer tensor of this tensor's shape: which entry of the site's value (or which
    component, as the caller coded it) each entry comes from."""

    powers: dict[str, Fraction]
    factors: tuple
    origins: dict[str, torch.Tensor]

    @staticmethod
    def __new__(cls, value: torch.Tensor, powers: dict, factors=(), origins=None):
        out = value.as_subclass(cls)
        out.powers, out.factors, out.origins = powers, factors, origins or {}
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bare = [_bare(a) for a in args]
        out = func(*bare, **{k: _bare(v) for k, v in kwargs.items()})
        # (``to`` and ``contiguous`` may return their argument unchanged)
        in_place = bare and (out is bare[0] or func is torch.Tensor.__setitem__)
        in_place = in_place and func not in _MOVES
        if in_place and isinstance(args[0], _Form):  # changed in place: the form is lost
            args[0].powers = {**args[0].powers, _CHANGED: Fraction(1)}
            return args[0]
        if func is torch.broadcast_tensors:
            moved = (
                _moved(a, o, torch.Tensor.expand, (o.shape,), {})
                for a, o in zip(args, out, strict=True)
            )
            return type(out)(moved)
        if not isinstance(out, torch.Tensor) or not out.is_floating_point():
            return out
        first = args[0] if args else None
        if func in _MOVES and isinstance(first, _Form):
            return _moved(first, out, func, bare[1:], kwargs)
        if kwargs:
            return out  # out=, rounding_mode=, alpha=, ...: not a plain product
        if any(isinstance(a, Logarithm) for a in args):
            return _logarithm(func, out, args)
        if func in _LOG and isinstance(first, Monomial):
            return Logarithm(out, dict(first.powers), first.factors, dict(first.origins))
        if func in _POWERS and isinstance(first, Monomial):
            return _power(first, out, _POWERS[func])
        if func in _POW and isinstance(first, Monomial) and len(args) == 2:
            q = _fraction(args[1])
            return out if q is None else _power(first, out, q)
        if func in _MUL and len(args) == 2:
            return _product(out, args[0], args[1], 1)
        if func in _DIV and len(args) == 2:
            return _product(out, args[0], args[1], -1)
        if func in _RDIV and len(args) == 2:  # number / monomial
            return _product(out, args[1], args[0], -1)
        if func in _MATMUL and len(args) == 2:  # one-hot rows @ monomial: a selection
            return _selection(out, args[0], args[1])
        return out


class Monomial(_Form):
    """A tensor equal to K · Π_s τ_s^(e_s) (the fields are :class:`_Form`'s)."""

    @classmethod
    def of(cls, value: torch.Tensor, site: str, origin: torch.Tensor | None = None) -> Monomial:
        """The value of the latent site ``site``: τ¹ (with the codes ``origin``, if given,
        of its entries)."""
        return cls(plain(value), {site: Fraction(1)}, (), {} if origin is None else {site: origin})


class Logarithm(_Form):
    """A tensor equal to ln(K · Π_s τ_s^(e_s)) = ln K + Σ_s e_s ln τ_s (the fields are
    :class:`_Form`'s)."""


def plain(t):
    """``t`` as a plain tensor (a :class:`Monomial`'s or a :class:`Logarithm`'s form
    dropped); anything else as it is."""
    return t.as_subclass(torch.Tensor) if isinstance(t, _Form) else t


def origin(t: torch.Tensor, site: str) -> torch.Tensor | None:
    """The codes of :meth:`Monomial.of` carried to each entry of ``t`` where ``t`` is
    c · τ over the site alone (a copy or a scaled copy of entries of its value, moved
    by indexing and views); else ``None``."""
    if not isinstance(t, Monomial) or site not in t.origins:
        return None
    powers = {s: e for s, e in t.powers.items() if e != 0}
    return t.origins[site] if powers == {site: Fraction(1)} else None


def same_form(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``value`` with the form of ``like`` (where ``value`` is ``like`` up to rounding, e.g.
    a precision matrix symmetrised)."""
    if not isinstance(like, _Form):
        return value
    return type(like)(plain(value), dict(like.powers), like.factors, dict(like.origins))


def coefficient(t: torch.Tensor, sites: list[str]) -> torch.Tensor | None:
    """c where ``t`` is the monomial c · Π τ_s over exactly these ``sites`` (each to the
    power 1), as a plain tensor of ``t``'s shape and dtype; else ``None``. A constant to
    the power 1 enters as it is; a product of several is formed in floating point."""
    if not isinstance(t, Monomial):
        return None
    powers = {s: e for s, e in t.powers.items() if e != 0}
    if powers != {s: Fraction(1) for s in sites}:
        return None
    number, c = 1.0, None
    for base, e in t.factors:
        if e == 0:
            continue
        if isinstance(base, torch.Tensor):
            f = base if e == 1 else base.pow(float(e))
            c = f if c is None else c * f
        else:
            number *= base if e == 1 else base ** float(e)
    value = plain(t)
    if c is None:
        return torch.tensor(number, dtype=value.dtype, device=value.device).expand(value.shape)
    c = c.to(value.dtype)
    return c if number == 1.0 else c * number


def _bare(a):
    """An argument with its monomials (also inside a list or tuple) as plain tensors: the
    operation then runs on plain tensors alone."""
    if isinstance(a, (list, tuple)):
        return type(a)(plain(x) for x in a)
    return plain(a)


def _fraction(q) -> Fraction | None:
    """A Python number as an exact small fraction (-0.5 -> -1/2), else ``None``."""
    if isinstance(q, bool) or not isinstance(q, Real):
        return None
    f = Fraction(q).limit_denominator(64)
    return f if float(f) == float(q) else None


def _moved(m, out: torch.Tensor, func, rest: tuple, kwargs: dict):
    """``out = func(m, *rest)`` with ``func`` applied alike to m's tensor factors and to
    its origins (but for a change of dtype: they stay integers)."""
    if not isinstance(m, _Form):
        return out
    factors = tuple(
        (func(plain(b), *rest, **kwargs) if isinstance(b, torch.Tensor) else b, e)
        for b, e in m.factors
    )
    if func in _RETYPES:
        origins = {s: o.expand(out.shape) for s, o in m.origins.items()}
    else:
        origins = {s: func(o, *rest, **kwargs) for s, o in m.origins.items()}
    return type(m)(out, dict(m.powers), factors, origins)


def _power(m: _Form, out: torch.Tensor, q: Fraction) -> _Form:
    """``out`` = m^q for a monomial, q · m for a logarithm: every exponent times q."""
    powers = {s: e * q for s, e in m.powers.items()}
    return type(m)(out, powers, tuple((b, e * q) for b, e in m.factors), dict(m.origins))


def _logarithm(func, out: torch.Tensor, args: tuple):
    """``out = func(*args)`` where an argument is a :class:`Logarithm`: a logarithm again
    for a product with (or a quotient by) a number, a negation, or a sum or difference of
    two logarithms; a monomial for its exponential; else ``out`` as it is."""
    a, b = (args + (None,))[:2]
    if len(args) == 1 and func in _EXP:
        return Monomial(out, dict(a.powers), a.factors, dict(a.origins))
    if len(args) == 1 and func in _NEG:
        return _power(a, out, Fraction(-1))
    if len(args) != 2:
        return out
    if func in _MUL or (func in _DIV and isinstance(a, Logarithm)):
        log, q = (a, b) if isinstance(a, Logarithm) else (b, a)
        q = None if isinstance(q, torch.Tensor) else _fraction(q)
        if q is None or q == 0:
            return out
        return _power(log, out, q if func in _MUL else 1 / q)
    if (func in _ADD or func in _SUB) and isinstance(a, Logarithm) and isinstance(b, Logarithm):
        sign = 1 if func in _ADD else -1
        powers = dict(a.powers)
        for site, e in b.powers.items():
            powers[site] = powers.get(site, Fraction(0)) + sign * e
        factors = tuple((_shaped(f, out), e) for f, e in a.factors)
        factors += tuple((_shaped(f, out), sign * e) for f, e in b.factors)
        origins = {site: o.expand(out.shape) for x in (a, b) for site, o in x.origins.items()}
        return Logarithm(out, powers, factors, origins)
    return out


def _product(out: torch.Tensor, a, b, sign: int):
    """``out = a · b^sign``: a monomial when each of a and b is a monomial, a number or a
    plain tensor (a constant), and at least one is a monomial."""
    if not (isinstance(a, Monomial) or isinstance(b, Monomial)):
        return out
    powers: dict[str, Fraction] = {}
    factors, origins = [], {}
    for x, s in ((a, 1), (b, sign)):
        if isinstance(x, Monomial):
            for site, e in x.powers.items():
                powers[site] = powers.get(site, Fraction(0)) + s * e
            factors += [(_shaped(f, out), s * e) for f, e in x.factors]
            origins.update({site: o.expand(out.shape) for site, o in x.origins.items()})
        elif isinstance(x, torch.Tensor):
            if not x.is_floating_point():
                return out
            factors.append((_shaped(x, out), Fraction(s)))
        elif isinstance(x, Real) and not isinstance(x, bool):
            factors.append((float(x), Fraction(s)))
        else:
            return out
    return Monomial(out, powers, tuple(factors), origins)


def _selection(out: torch.Tensor, a, m):
    """``out = a @ m`` as a move of m's rows where ``a`` is a constant whose rows are one-hot
    (each picks one row of m: labels as a one-hot matrix); else ``out`` as it is."""
    if not isinstance(m, Monomial) or isinstance(a, Monomial) or not torch.is_tensor(a):
        return out
    if not a.is_floating_point() or a.dim() < 2:
        return out
    if not bool(((a == 0) | (a == 1)).all() & (a.sum(-1) == 1).all()):
        return out
    factors = tuple((a @ plain(b) if torch.is_tensor(b) else b, e) for b, e in m.factors)
    origins = {s: (a @ o.to(a.dtype)).to(o.dtype) for s, o in m.origins.items()}
    return Monomial(out, dict(m.powers), factors, origins)


def _shaped(f, out: torch.Tensor):
    """A factor broadcast to the shape of the product it enters (numbers as they are)."""
    return plain(f).expand(out.shape) if isinstance(f, torch.Tensor) else f
