"""The family record and its registry (docs/design/vmp.md §7).

A :class:`Family` is everything VMP knows of one exponential family, in one place (as
BayesPy keeps a node's messages, moments and bound in one module): which parents each of
its parameters takes (its roles, and the conjugate one), how its parameters and data are
read off a Pyro distribution, the values the compiler probes it at, its factor's block of
natural parameters and moments (:mod:`probfsl.inference.expfam`), and its messages and
bound terms. Each family is one module of :mod:`probfsl.inference.vmp.families` that
subclasses :class:`Family` and registers it (:func:`register`); the compiler and the
message passing look records up here (:func:`lookup`, :func:`of_distribution`) and never
branch on a family's name.

This module imports nothing else of VMP: every other module may use the registry.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

#: a :class:`~probfsl.inference.vmp.layout.Site` and a :class:`~probfsl.inference.vmp.layout.Plan`
#: (not imported: the layout itself looks families up here)
Site = Any
Plan = Any

#: family name -> its record
REGISTRY: dict[str, Family] = {}
#: the Pyro distribution class -> its record
BY_CLASS: dict[type, Family] = {}


class Family:
    """One family as VMP uses it. The defaults describe an elementwise family with two
    statistics and no parents; a family module overrides what differs.

    Reading (the compiler): :attr:`roles` (parameter -> the families of the parents it may
    take, a selecting Categorical included), :attr:`conjugate` (parameter -> its conjugate
    parent's family), :attr:`hints` (what a parameter may be, for a refusal),
    :meth:`read_params`, :meth:`observe` (an observed site's data and statistics),
    :meth:`draw` and :meth:`extreme` (the values a latent site is probed at), and for a
    ``pyro.param`` of :attr:`point_constraint` the stand-in :meth:`placeholder`.

    The factor: :attr:`block` (its exponential-family block, natural parameters, moments,
    log-normaliser and entropy), :attr:`fields` (the block's parameters, in the order a
    factor holds them), :meth:`stat_dims`, :meth:`point_stats` and :meth:`point_mode` (a
    point estimate), :meth:`posterior`.

    Messages and bound terms: a child whose E ln p is linear in one parent's statistics
    names that parameter (:attr:`linear_parameter`) and gives its coefficients
    (:meth:`linear_terms`), from which
    :mod:`~probfsl.inference.vmp.conjugate_children` forms its messages and bound term.
    Any other family gives its own (:meth:`natural`, :meth:`message`, :meth:`loglik`:
    the Gaussian, Categorical and hidden-Markov algebra of
    :mod:`~probfsl.inference.vmp.normal`, :mod:`~probfsl.inference.vmp.mvn` and
    :mod:`~probfsl.inference.vmp.hmm`), which :mod:`~probfsl.inference.vmp.messages`
    dispatches to.

    Starting values (:mod:`~probfsl.inference.vmp.starts`): :meth:`start_at_mean` (a
    factor moved to a given mean) and :meth:`start_drawn` (its mean drawn from it). The
    supported forms in words: :attr:`forms` (:data:`~probfsl.inference.vmp.supported.SUPPORTED`).
    """

    name: ClassVar[str]
    pyro_class: ClassVar[type]
    #: the parameters read off the Pyro distribution, by their attribute names
    parameters: ClassVar[tuple[str, ...]] = ()
    roles: ClassVar[dict[str, tuple[str, ...]]] = {}
    conjugate: ClassVar[dict[str, str]] = {}
    #: the model's name of a parameter the canonical layout reads otherwise (a precision)
    model_names: ClassVar[dict[str, str]] = {}
    hints: ClassVar[dict[str, str]] = {}
    #: taken as observed sites only (a latent discrete value is a Categorical)
    observed_only: ClassVar[bool] = False
    #: an observed site must depend on a latent site (a count's rate or probabilities)
    needs_latent_parent: ClassVar[bool] = False
    #: observed data are whole numbers >= 0 (counts, labels)
    whole_numbers: ClassVar[bool] = False
    #: its value enters its children's precisions and rates with their form c · τ
    symbolic: ClassVar[bool] = False
    #: a fixed prior's natural parameters are computed on the distinct values of its
    #: broadcast parameters
    elementwise: ClassVar[bool] = False
    #: so are the factor's moments, entropy and update from η (:func:`~probfsl.inference.
    #: vmp.moments.compact`), and its children's messages are added likewise
    compact_factor: ClassVar[bool] = False
    #: an affine map of sites of this family may be a parameter (linear maps, logits)
    gaussian: ClassVar[bool] = False
    #: its values are labels: a latent one may be masked, tempered by ``poutine.scale`` or
    #: partly observed (``obs_mask``), its data are integers, and it may select components
    labels: ClassVar[bool] = False
    #: taken as a latent site only
    latent_only: ClassVar[bool] = False
    #: its parameters are matrices that keep every axis (no reduction to constants)
    matrix: ClassVar[bool] = False
    #: its second statistic has a second copy of the last axis (x xᵀ)
    outer_axis: ClassVar[bool] = False
    #: the parameter that may be a product of several parents (a scale mixture)
    product_parameter: ClassVar[str | None] = None
    #: the parameter that may be an affine or bilinear map of Gaussian sites
    affine_parameter: ClassVar[str | None] = None
    #: a fixed table of this parameter may be selected by a latent Categorical
    selectable_constant: ClassVar[bool] = False
    #: parameters that are the logarithm of their parent (a DiscreteHMM's logits)
    log_parameters: ClassVar[tuple[str, ...]] = ()
    block: ClassVar[Any] = None
    fields: ClassVar[tuple[str, ...]] = ()
    #: the event axes of one draw of the family (a Dirichlet's 1, a Wishart's 2)
    event_rank: ClassVar[int] = 0
    #: its data must depend on a latent site with a rate c · λ, c > 0 where data > 0
    positive_exposure: ClassVar[bool] = False
    #: its probabilities may be logits affine in Gaussian sites (Pólya-Gamma)
    logistic: ClassVar[bool] = False
    #: a structured child with its own messages and bound term (a hidden Markov chain's,
    #: :mod:`~probfsl.inference.vmp.hmm`)
    structured: ClassVar[bool] = False
    #: the branch check predicts its parameters from the plan
    predictable: ClassVar[bool] = True
    point_constraint: ClassVar[Any] = None
    linear_parameter: ClassVar[str | None] = None
    #: the forms of this family VMP supports, in words, one phrase each (a line of
    #: docs/modelling.md#supported-forms): what each parameter of its :attr:`roles` may be,
    #: naming the parents' families; a subclass that shares its parent's phrase keeps it
    forms: ClassVar[tuple[str, ...]] = ()

    # ---- reading a site -------------------------------------------------------------
    def read_params(self, base: Any, site: Site) -> tuple[dict[str, torch.Tensor], bool]:
        """The parameters of the Pyro distribution ``base``, and whether they are already
        in the canonical layout (else they have the site's batch and event shape)."""
        return {k: getattr(base, k) for k in self.parameters}, False

    def categories(self, base: Any) -> int:
        """The number of categories of a label-valued family (0 for the others)."""
        return 0

    def reference(self, base: Any) -> torch.Tensor | None:
        """A parameter tensor of ``base`` whose device and dtype a probe value takes."""
        return next((v for v in base.__dict__.values() if torch.is_tensor(v)), None)

    def declare(self, site: Site, base: Any, sizes: dict) -> str | None:
        """Record the family's own axes in ``sizes`` (categories, states, the second axis
        of x xᵀ); a refusal's reason where the distribution is outside what VMP follows."""
        return None

    def takes_integer_data(self, base: Any) -> bool:
        """Whether an observed site's data may be integer (or bool) tensors, read as the
        model's floating dtype with the same checks as float data (``base``: the site's
        Pyro distribution): the data of a family of whole numbers or labels (counts,
        Bernoulli outcomes, labels)."""
        return self.whole_numbers or self.labels

    def data_limit(self, base: Any, site: Site) -> tuple[Any, str] | None:
        """(the largest value the data may take, the refusal's reason) for bounded counts."""
        return None

    def data_stats(self, value: torch.Tensor) -> tuple:
        """u(x) of observed data (canonical layout)."""
        return (value, value.square())

    def observe(self, site: Site, value: torch.Tensor, dtype: torch.dtype) -> None:
        """Store an observed site's data (canonical layout) and statistics on it (``dtype``:
        the floating dtype of the model)."""
        site.value = value
        site.stats = self.data_stats(value)

    def checked_stats(self, site: Site) -> tuple:
        """The tensors whose finiteness the compiler checks (the data and their statistics)."""
        return (site.value, *site.stats)

    def support(self, value: torch.Tensor) -> torch.Tensor | None:
        """A 0-d bool tensor: observed data lie in the support (``None``: no bound, or
        checked elsewhere)."""
        return None

    def outside(self, value: torch.Tensor) -> tuple[torch.Tensor, str] | None:
        """(the entries outside the support, the support in words), for a refusal."""
        return None

    def refusal(self, site: str, fn: str, value: torch.Tensor, dims: tuple) -> ValueError | None:
        """A refusal of data outside the support in the family's own words (a Dirichlet's
        rows); ``None``: :meth:`outside` names the entries."""
        return None

    def draw(self, shape: list, n_cat: int, generator: torch.Generator) -> torch.Tensor | None:
        """A value away from the edges of the support (float64 or int64, CPU); ``None``
        where the model's own sampler decides."""
        return None

    def extreme(self, shape: list, n_cat: int, pattern: str) -> torch.Tensor | None:
        """A value at the ``"high"`` or ``"low"`` end of the support (the structure check)."""
        return None

    def placeholder(self, value: torch.Tensor) -> Any:
        """A law with the shape and support of ``value`` (a ``pyro.param``'s stand-in);
        only the families that can be point estimates have one."""
        raise self._no_point_estimate()

    def unit(self, shape: list, ref: torch.Tensor) -> torch.Tensor:
        """The unit of a scaled parameter c · parent (ones; identity matrices)."""
        return ref.new_ones(shape)

    def param_dims(self, site: Site, key: str) -> tuple:
        """The axes of parameter ``key``."""
        return site.dims

    # ---- the factor -----------------------------------------------------------------
    def stat_dims(self, site: Site) -> tuple:
        """The axes of each expected sufficient statistic."""
        return (site.dims, site.dims)

    def point_stats(self, value: torch.Tensor) -> tuple:
        """u(θ) of a point estimate θ."""
        raise self._no_point_estimate()

    def point_mode(self, eta: tuple, site: Site) -> torch.Tensor:
        """argmax_θ η·u(θ): the point that maximises its children's terms."""
        raise self._no_point_estimate()

    def posterior(self, params: list) -> torch.distributions.Distribution:
        """The factor as a distribution (parameters in the model's shapes); a family that
        is only ever observed has none."""
        raise ValueError(f"VMP has no posterior factor for {self.name}: it is only observed")

    def _no_point_estimate(self) -> ValueError:
        points = ", ".join(name for name, f in REGISTRY.items() if f.can_be_point())
        return ValueError(
            f"VMP cannot hold a {self.name} parameter as a point estimate (pyro.param); "
            f"point estimates are of the families {points}"
        )

    @classmethod
    def can_be_point(cls) -> bool:
        """Whether this family defines the point-estimate methods."""
        return cls.point_mode is not Family.point_mode

    # ---- starting values (:mod:`~probfsl.inference.vmp.starts`) ------------------------
    def start_at_mean(self, site: Site, factor: tuple, value: torch.Tensor) -> tuple:
        """``factor`` (the prior's, canonical layout) moved to the mean ``value`` (canonical),
        its spread kept (``init={site: mean}``); ``ValueError`` naming the site where
        ``value`` cannot be a mean of the family. Only the families whose factor a mean
        and the prior's spread determine have it (:meth:`takes_mean`)."""
        raise ValueError(f"init cannot start site {site.name!r}: a {site.fn_name} factor")

    def start_drawn(self, site: Site, factor: tuple, generator: torch.Generator) -> tuple:
        """``factor`` (the prior's) with its mean drawn from it by ``generator`` (a CPU
        generator; ``init="prior"``). Only the families that have it (:meth:`draws_start`)."""
        raise ValueError(f"init cannot draw the start of site {site.name!r}: a {site.fn_name}")

    @classmethod
    def takes_mean(cls) -> bool:
        """Whether a start may give this family's factor by its mean (:meth:`start_at_mean`)."""
        return cls.start_at_mean is not Family.start_at_mean

    @classmethod
    def draws_start(cls) -> bool:
        """Whether ``init="prior"`` draws this family's mean (:meth:`start_drawn`)."""
        return cls.start_drawn is not Family.start_drawn

    # ---- messages and bound terms (overridden by the families that have them) --------
    def natural(self, plan: Plan, q: dict, site: Site, kids: list) -> tuple[list, list] | None:
        """E[η(pa)] of the latent ``site``: its law's expected natural parameters given its
        parents (design §1), and those of its children ``kids`` ((name, role) pairs) whose
        messages remain to be added (a record may fold a child's message into the term as
        it forms it). ``None``: its prior's natural parameters, fixed and computed once per
        plan (:func:`~probfsl.inference.vmp.messages.prior`)."""
        return None

    def labels_update(self, plan: Plan, q: dict, site: Site) -> tuple | None:
        """The update of a latent label's factor from its prior and children, where the
        record forms it otherwise than as the softmax of :meth:`natural` plus the
        children's messages: ``(probs, lse)``, ``lse`` the per-task Σ ln Σ_k exp η of
        :func:`~probfsl.inference.vmp.messages.lse_applies` (``None`` where that does not
        apply). ``None``: the softmax of η."""
        return None

    def message(self, plan: Plan, q: dict, site: Site, role: str, to: Site) -> list | None:
        """m_{site → to}: the coefficients of u(to) in E ln p(site | pa), ``to`` its parent
        in ``role`` (a parameter, or ``"select"`` for a selector: E ln p per component).
        ``None``: a linear child's (:mod:`~probfsl.inference.vmp.conjugate_children`)."""
        return None

    def loglik(self, plan: Plan, q: dict, site: Site, out: tuple) -> torch.Tensor | None:
        """E_q ln p(site | pa) summed into the axes ``out`` (the bound's term). ``None``: a
        linear child's, or its fixed prior's
        (:func:`~probfsl.inference.vmp.messages.site_elbo`)."""
        return None

    def linear_child(self, site: Site) -> str | None:
        """The parameter through which ``site`` is a linear child of a parent (``None``:
        it is not one)."""
        key = self.linear_parameter
        if key is None or key not in site.params or site.params[key].parent is None:
            return None
        return key

    def linear_terms(self, plan: Plan, q: dict, site: Site) -> tuple[list, list]:
        """E ln p(x | parent) = Σ_i coef_i ⟨u_i(parent)⟩ + const as (coefs, const), each a
        list of (sign, operands) (:mod:`~probfsl.inference.vmp.conjugate_children`); only
        a family with a ``linear_parameter`` has them."""
        raise ValueError(f"VMP has no conjugate-child terms for {self.name}")


def register(cls: type[Family]) -> type[Family]:
    """Add a family to the registry (a class decorator)."""
    record = cls()
    REGISTRY[cls.name] = record
    BY_CLASS[cls.pyro_class] = record
    return cls


def lookup(name: str) -> Family:
    """The record of the family ``name``."""
    return REGISTRY[name]


def of_distribution(fn: Any) -> Family | None:
    """The record of a Pyro distribution's exact class (``None``: not a family VMP knows)."""
    return BY_CLASS.get(type(fn))


def floored(log_value: torch.Tensor) -> torch.Tensor:
    """A logarithm clamped at ln(tiny) of its dtype: a probability of exactly 0 or 1 (a task
    whose data are all 0 or all 1; a component no entry takes) keeps its terms 0 · ln π at
    0, as fixed probabilities do."""
    return log_value.clamp_min(math.log(torch.finfo(log_value.dtype).tiny))
