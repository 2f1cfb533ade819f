"""The estimator interface shared by every few-shot method.

An estimator holds its hyperparameters from ``__init__``; ``fit_base`` learns the
statistics a method is allowed to take from the labelled base classes (centring
means, within-class scatter, ...); ``predict_proba`` classifies the queries of a
batch of tasks at once. Fitted attributes end in ``_``.

Input checks come from :mod:`probfsl.validation`: every ``fit_base`` accepts
tensors or NumPy arrays and every ``predict_proba`` checks its episodes before
computing.

**One estimator surface** (after scikit-learn's estimator checks): every
estimator has ``fit(features, labels)`` (= ``fit_base``, on every estimator: the base
classes), ``get_params``/``set_params``, ``predict_proba(episodes)`` for a batch of
tasks that never changes the fitted state (it may leave per-call diagnostics, listed in
``call_diagnostics``), and, for one task (or a batch) given as plain arrays or tensors,
``fit_predict(support, support_labels, query)`` (labels) and
``fit_predict_proba(support, support_labels, query)`` (a :class:`TaskProbabilities`:
the classes and the ``[Q, K]`` probabilities of the queries, columns in the order of
``classes``), with support labels of any sortable type (integers, strings, pandas
categories); and ``save(path)`` / ``load(path)`` (:mod:`probfsl.estimator_io`, no
pickle). ``tests/test_estimator_checks.py`` runs every registered method through it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Self

import numpy as np
import torch

from probfsl.data.featureset import FeatureSet
from probfsl.data.preprocess import center_and_normalize
from probfsl.data.tasks import Episodes
from probfsl.schema import (
    FEATURE_BOUND,
    Choice,
    EstimatorSchema,
    Flag,
    Group,
    Int,
    Real,
    Tensor,
)
from probfsl.validation import (
    as_device,
    as_float_tensor,
    as_label_tensor,
    as_user_array,
    check_base,
    check_episodes,
    check_flag,
    check_float_dtype,
)

if TYPE_CHECKING:  # the inference modules are imported where they are used
    from probfsl.inference.background import BackgroundStats, TwoCovarianceReading

__all__ = [
    "BACKGROUND",
    "BASE_MEAN",
    "ENGINE",
    "ENGINE_NAMES",
    "BaseMeanCentering",
    "FewShotClassifier",
    "Hyperparameters",
    "MIN_BACKGROUND_CLASSES",
    "OPEN_PRIOR",
    "OpenSetBackground",
    "TaskProbabilities",
    "check_engine_name",
    "encode_task_labels",
    "episodes_from_arrays",
    "shared_backgrounds",
]

#: the fewest base classes the open-set background is learnt from: with one, the spread of
#: the class means (the between-class covariance) is zero
MIN_BACKGROUND_CLASSES = 2

#: the names of the inference engines of the five methods of the papers (the values of
#: an estimator's ``engine``): ``"handwritten"``, the closed-form updates derived by hand
#: for the method; ``"derived"``, the updates that variational message passing derives
#: from the method's Pyro declaration. Each method's engines are registered under these
#: names in the ``ENGINES`` dict of its module of :mod:`probfsl.derived`
ENGINE_NAMES = ("handwritten", "derived")
#: the declaration of an ``engine`` hyperparameter (:data:`ENGINE_NAMES`)
ENGINE = Choice(ENGINE_NAMES)
#: the fitted attributes of ``fit_base`` for the methods that only centre on the base mean:
#: ``base_mean_ [D]``, D the width of the base features
BASE_MEAN = Group("fit_base", {"base_mean_": Tensor("D", bound=FEATURE_BOUND)})
#: the fitted attributes of the open-set background (:class:`OpenSetBackground`), set by
#: ``fit_base`` in the feature space the method classifies in: the base classes' mean of
#: class means ``background_mean_ [D]``, pooled within-class covariance
#: ``background_within_ [D, D]`` and between-class covariance ``background_between_ [D, D]``
#: (:func:`probfsl.inference.background.fit_background`), both shrunk by
#: ``background_shrinkage_`` (:func:`probfsl.inference.background_shrinkage.select_shrinkage`),
#: and, chosen on episodes of held-out base classes
#: (:func:`probfsl.inference.open_temperature.select_open_reading`), the isotropic blends
#: of the two covariances ``background_within_mix_`` and ``background_between_mix_`` and
#: the scale and shift of the inductive open log-odds ``background_odds_scale_`` and
#: ``background_odds_shift_``, and the same four for the transductive reading in the
#: queries' frame (``background_query_*``), and ``background_held_out_``, whether they
#: were (``False``: too few base classes to hold out; the fallback of
#: :data:`probfsl.inference.open_temperature.UNSPLIT_READING`); all but the first three are
#: absent from files saved before they were chosen (read as 0, 0, 1 and a shift of 0)
BACKGROUND = Group(
    "fit_base",
    {
        "background_mean_": Tensor("D", bound=FEATURE_BOUND),
        "background_within_": Tensor("D", "D", bound=FEATURE_BOUND),
        "background_between_": Tensor("D", "D", bound=FEATURE_BOUND),
        "background_shrinkage_": Real(nonnegative=True),
        "background_odds_scale_": Real(positive=True),
        "background_odds_shift_": Real(),
        "background_within_mix_": Real(low=0.0, high=1.0),
        "background_between_mix_": Real(low=0.0, high=1.0),
        "background_query_within_mix_": Real(low=0.0, high=1.0),
        "background_query_between_mix_": Real(low=0.0, high=1.0),
        "background_query_odds_scale_": Real(positive=True),
        "background_query_odds_shift_": Real(),
        "background_held_out_": Flag(),
    },
    optional=frozenset(
        {
            "background_held_out_",
            "background_shrinkage_",
            "background_odds_scale_",
            "background_odds_shift_",
            "background_within_mix_",
            "background_between_mix_",
            "background_query_within_mix_",
            "background_query_between_mix_",
            "background_query_odds_scale_",
            "background_query_odds_shift_",
        }
    ),
)
#: the declaration of the ``open_prior`` hyperparameter: the prior probability π_0 that a
#: query belongs to none of the task's classes (inductive methods: fixed; transductive
#: methods: the mean of the Beta prior of the open fraction inferred per task)
OPEN_PRIOR = Real(positive=True, high=0.99)
#: ``open_neighbours`` of the transductive methods: how many nearest queries P(open) is
#: averaged over (:meth:`OpenSetBackground.tempered_open`; 0: none)
OPEN_NEIGHBOURS = Int(nonnegative=True)


def check_engine_name(engine: Any) -> str:
    """``engine`` if it is one of :data:`ENGINE_NAMES`; ``ValueError`` listing them otherwise."""
    ENGINE.check("engine", engine)
    return engine


class Hyperparameters:
    """scikit-learn's hyperparameter convention: ``__init__`` stores its arguments under
    their own names and does nothing else; :meth:`get_params`/:meth:`set_params` read and
    write them (so ``sklearn.base.clone`` works) and :meth:`check_params` validates them,
    before every fit and prediction.

    ``schema`` declares, once, every hyperparameter's type and range and every fitted
    attribute's form (:class:`probfsl.schema.EstimatorSchema`): :meth:`check_params`
    checks against it, and so does loading a saved estimator."""

    #: the declared hyperparameters and fitted attributes (``None``: nothing declared)
    schema: ClassVar[EstimatorSchema | None] = None

    @classmethod
    def _param_names(cls) -> list[str]:
        """The hyperparameters: the arguments of ``__init__``."""
        return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]

    def get_params(self, deep: bool = True) -> dict:
        """Hyperparameters as given to ``__init__``, read from the attributes of the same
        names (scikit-learn's convention, so ``sklearn.base.clone`` works; ``deep`` is
        accepted for that interface: no hyperparameter is itself an estimator)."""
        return {k: getattr(self, k) for k in self._param_names() if hasattr(self, k)}

    def set_params(self, **params: Any) -> Self:
        """Change hyperparameters; returns ``self``.

        ``ValueError`` listing the accepted names for a name that is not an ``__init__``
        argument. The new values are stored and checked by :meth:`check_params` (fitted
        attributes are kept). Fitted statistics derived from a changed hyperparameter
        (e.g. BAVARDAGE's relative-scale whitening) are refreshed only by a new ``fit``.
        """
        accepted = self._param_names()
        unknown = sorted(set(params) - set(accepted))
        if unknown:
            raise ValueError(
                f"{type(self).__name__}: unknown hyperparameter(s) {unknown}; "
                f"accepted: {', '.join(accepted)}"
            )
        previous = {name: getattr(self, name) for name in params if hasattr(self, name)}
        for name, value in params.items():
            setattr(self, name, value)
        try:
            return self.check_params()
        except (TypeError, ValueError):
            for name in params:  # a refused value leaves the estimator as it was
                if name in previous:
                    setattr(self, name, previous[name])
                else:
                    delattr(self, name)
            raise

    def check_params(self) -> Self:
        """Check the hyperparameters (``TypeError``/``ValueError`` naming the first bad
        one); returns ``self``. ``__init__`` only stores its arguments (scikit-learn's
        convention), so this runs before every fit and prediction, and at once in
        :func:`probfsl.make_estimator` and :meth:`set_params`."""
        self._check_params()
        return self

    def _check_params(self) -> None:
        """Raise on an invalid hyperparameter (``TypeError``/``ValueError`` naming the first
        bad one, in the order of :attr:`schema`); never changes an attribute. A subclass
        with rules that tie hyperparameters together adds them after this."""
        if self.schema is not None:
            self.schema.check_params(self)


class TaskProbabilities(NamedTuple):
    """What :meth:`FewShotClassifier.fit_predict_proba` returns: the classes of a task and
    its query probabilities, column ``k`` of ``proba`` for ``classes[k]``.

    It unpacks as a pair, ``classes, proba = model.fit_predict_proba(support, labels,
    query)``, or reads by name (``result.proba``).
    """

    #: the task's classes, its sorted distinct support labels in the caller's values:
    #: ``[K]`` for one task, ``[T, K]`` for a batch
    classes: np.ndarray | torch.Tensor
    #: query probabilities ``[Q, K]`` (batch: ``[T, Q, K]``), each row summing to 1; with
    #: ``open_set=True`` one more column, last: P(none of these classes)
    proba: np.ndarray | torch.Tensor

    def labels(self) -> np.ndarray | torch.Tensor:
        """The most probable class of each query, in the caller's label values
        (``[Q]``, batch ``[T, Q]``): what :meth:`FewShotClassifier.fit_predict` returns."""
        index = self.proba.argmax(-1)
        if isinstance(self.classes, torch.Tensor):
            index = torch.as_tensor(index, device=self.classes.device)
            if self.classes.ndim == 1:
                return self.classes[index]
            return self.classes.gather(-1, index)
        index = index.cpu().numpy() if isinstance(index, torch.Tensor) else index
        if self.classes.ndim == 1:
            return self.classes[index]
        return np.take_along_axis(self.classes, index, axis=-1)


class FewShotClassifier(Hyperparameters, ABC):
    """Batched few-shot classifier: ``[T]`` tasks in, ``[T, Q, K]`` query probabilities out."""

    #: whether the method uses the unlabelled queries of a task jointly
    transductive: bool = False
    #: whether ``fit_base`` must be called before ``predict_proba``
    needs_base: bool = False
    #: whether relabelling a task's classes permutes the columns of ``predict_proba``
    #: exactly (False for a Monte Carlo method whose random streams follow the labels:
    #: its columns are then permuted in distribution only)
    relabelling_exact: bool = True

    def setting_note(self, way: int, shot: int) -> str:
        """One line a user should read beside results at this task setting: where the
        method reduces to a simpler one (``""`` when nothing needs saying)."""
        return ""

    def open_background_note(self) -> str | None:
        """One line a user should read beside open-set results: where P(open) could not
        be tuned on held-out base classes (``None`` when nothing needs saying; methods
        with a background, :class:`OpenSetBackground`, and wrappers say more)."""
        return None

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Learn base-class statistics from ``features`` [N, D] and ``labels`` [N]
        (tensors or NumPy arrays; checked by :func:`~probfsl.validation.check_base`)."""
        check_base(features, labels)
        return self

    def fit_featureset(
        self,
        fs: FeatureSet,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> Self:
        """Learn what the method may take from a FeatureSet before any task (its base
        classes), from tensors of ``dtype`` on ``device`` (default the CPU): the fitted
        statistics then live there, with the tasks they will meet."""
        if not isinstance(fs, FeatureSet):
            raise TypeError(f"fs must be a FeatureSet, got {type(fs).__name__}")
        check_float_dtype("dtype", dtype)
        device = as_device(device)
        if self.needs_base:
            self.fit_base(*fs.base(dtype, device))
        return self

    def prepare(self, episodes: Episodes) -> None:
        """Work done once per task shape before any prediction of it, such as the search
        of ``preset="auto"`` or fitting a temperature on base-class episodes; evaluation
        times it apart from the predictions. ``predict_proba`` runs it where it has not
        run, so calling it is optional. Most estimators have none."""

    @abstractmethod
    def predict_proba(self, episodes: Episodes) -> torch.Tensor:
        """Class probabilities ``[T, Q, K]`` for the queries of every task."""

    def predict_proba_open(self, episodes: Episodes) -> torch.Tensor:
        """Open-set probabilities ``[T, Q, K+1]`` for the queries of every task.

        Columns ``0..K-1`` are the task's classes and the last column is the posterior
        probability that the query belongs to none of them (a background component of the
        method's generative model, fitted on the base classes by ``fit_base``; see
        :mod:`probfsl.inference.background` and the methods' page on open-set
        recognition). Rows sum to 1; :meth:`predict_proba` is unchanged. ``ValueError``
        when the method has no open-set posterior or was not fitted on base classes.
        """
        raise ValueError(f"{type(self).__name__} has no open-set posterior (predict_proba_open)")

    #: attributes that ``predict_proba`` rewrites on each call (diagnostics of the last
    #: batch): not part of the fitted state, not saved
    call_diagnostics: tuple[str, ...] = ()

    def fit(self, features: Any, labels: Any) -> Self:
        """Alias of :meth:`fit_base` (scikit-learn's name): base statistics from
        ``features`` [N, D] and ``labels`` [N]; returns ``self``."""
        return self.fit_base(features, labels)

    def predict(self, episodes: Episodes) -> torch.Tensor:
        """Predicted task-local labels ``[T, Q]``."""
        return self.predict_proba(episodes).argmax(-1)

    def fit_predict(
        self, support: Any, support_labels: Any, query: Any
    ) -> torch.Tensor | np.ndarray:
        """Fit on each task's support (and queries, when transductive) and predict its queries.

        Plain arrays or tensors, ``support`` [n, D], ``support_labels`` [n], ``query``
        [Q, D] (one task) or ``[T, n, D]``, ``[T, n]``, ``[T, Q, D]`` (a batch). Each task's
        classes are its distinct support labels in increasing order (every task of a batch
        needs as many), and the predictions are returned in those label values, ``[Q]`` for
        one task or ``[T, Q]``:

        * integer labels (or whole-number floats): an integer NumPy array, or a tensor on
          the query's device when ``query`` is a tensor;
        * labels of any other sortable type (strings, booleans, a pandas ``Categorical``
          or Series, Python objects that compare with each other): a NumPy array of the
          labels as given (the dtype of ``numpy.unique`` of them: ``<U5`` for strings,
          ``object`` for mixed objects), whatever the type of ``query``.

        :meth:`fit_predict_proba` gives the probabilities behind these predictions (its
        argmax is this). An :class:`~probfsl.data.tasks.Episodes` batch goes to
        :meth:`predict` instead.

        NumPy input is converted as scikit-learn's input checks do (float16, bool and
        integer features to float32; :func:`~probfsl.validation.as_user_array`), and a
        pandas DataFrame (a column per dimension, or one column of arrays) or Series is
        taken as its values, so ``load_dataset(...).features`` rows go in as they are.
        """
        episodes, classes, values, single = _task_arrays(support, support_labels, query)
        local = self.predict(episodes)
        if values is not None:
            labels = np.take_along_axis(values, local.cpu().numpy(), axis=1)
            return labels[0] if single else labels
        labels = classes.gather(1, local)
        labels = labels[0] if single else labels
        return labels if isinstance(query, torch.Tensor) else labels.cpu().numpy()

    def fit_predict_proba(
        self, support: Any, support_labels: Any, query: Any, open_set: bool = False
    ) -> TaskProbabilities:
        """Class probabilities of the queries of one task (or a batch) given as arrays.

        The arrays are those of :meth:`fit_predict` (``support`` [n, D], ``support_labels``
        [n] of any sortable type, ``query`` [Q, D]; or a batch ``[T, n, D]``, ``[T, n]``,
        ``[T, Q, D]``). Returns a :class:`TaskProbabilities` ``(classes, proba)``:
        ``classes`` [K] holds the task's classes, its sorted distinct support labels in the
        caller's values, and ``proba`` [Q, K] the probabilities, rows summing to 1, column
        ``k`` for ``classes[k]`` (batches: ``[T, K]`` and ``[T, Q, K]``). ``proba`` is a
        NumPy array, or a tensor on the query's device when ``query`` is a tensor;
        ``classes`` is a NumPy array, or a tensor likewise for integer labels.

        ``classes[proba.argmax(-1)]`` is :meth:`fit_predict`'s answer. The fitted state is
        not changed (as :meth:`predict_proba`, which takes an
        :class:`~probfsl.data.tasks.Episodes` batch and returns ``[T, Q, K]`` in task-local
        class order).

        ``open_set=True``: the queries may belong to none of the task's classes, and
        ``proba`` has K + 1 columns, the last P(none of these classes)
        (:meth:`predict_proba_open`; ``classes`` still lists the K classes).
        """
        check_flag("open_set", open_set)
        episodes, classes, values, single = _task_arrays(support, support_labels, query)
        proba = self.predict_proba_open(episodes) if open_set else self.predict_proba(episodes)
        proba = proba[0] if single else proba
        if values is not None:
            task_classes: np.ndarray | torch.Tensor = values[0] if single else values
        else:
            task_classes = classes[0] if single else classes
            if not isinstance(query, torch.Tensor):
                task_classes = task_classes.cpu().numpy()
        if not isinstance(query, torch.Tensor):
            proba = proba.detach().cpu().numpy()
        return TaskProbabilities(task_classes, proba)

    def fitted_state(self) -> dict[str, Any]:
        """The fitted attributes (names ending in ``_``), without ``call_diagnostics``."""
        return {
            k: v
            for k, v in vars(self).items()
            if k.endswith("_") and not k.startswith("_") and k not in self.call_diagnostics
        }

    def restore_fitted_state(self, state: dict[str, Any]) -> None:
        """Set the attributes of :meth:`fitted_state` (used by :meth:`load`)."""
        for k, v in state.items():
            setattr(self, k, v)

    def save(self, path: str | Path) -> None:
        """Write the hyperparameters and fitted state to ``path`` (``torch.save`` of
        tensors and plain values, atomically; see :mod:`probfsl.estimator_io`).
        ``TypeError`` naming an attribute that cannot be saved safely."""
        from probfsl.estimator_io import save_estimator

        save_estimator(self, path)

    @classmethod
    def load(cls, path: str | Path) -> Self:
        """The estimator saved by :meth:`save` (read with ``torch.load(weights_only=True)``,
        tensors on the CPU); ``ValueError`` unless the file holds a registered probfsl
        estimator of this class."""
        from probfsl.estimator_io import load_estimator

        return load_estimator(path, expected=cls)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.get_params().items())
        return f"{type(self).__name__}({params})"


#: the held-out choices of :func:`held_out_background_choices` by a digest of their input
#: (the most recently used last): a search on base-class episodes fits every candidate on
#: the same base classes, and the choices depend on nothing else
_BACKGROUND_CHOICES: OrderedDict[str, tuple] = OrderedDict()
_BACKGROUND_CHOICES_KEPT = 8


def _digest(*tensors: torch.Tensor) -> str:
    """SHA-256 of the dtypes, shapes, device types and bytes of ``tensors``."""
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(f"{t.dtype} {tuple(t.shape)} {t.device.type}".encode())
        digest.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


#: the bases of :class:`~probfsl.inference.background.TwoCovarianceReading` (one D x D
#: factorisation each) by a digest of the blended statistics they diagonalise, most
#: recently used last: a search scores many candidates, each fitted on the same base
#: classes, over many batches (a basis holds a D x D matrix: 34 MB at D = 2,048 in float64,
#: so a few are kept, enough for both frames in two dtypes)
_READING_BASES: OrderedDict[str, tuple] = OrderedDict()
_READING_BASES_KEPT = 4


def reading_basis(stats) -> tuple:
    """:func:`~probfsl.inference.background.two_covariance_basis` of ``stats`` (a
    :class:`~probfsl.inference.background.BackgroundStats`), computed once for the last
    few distinct statistics (a digest of their values, dtype and device)."""
    from probfsl.inference.background import two_covariance_basis

    key = _digest(*stats)
    if key in _READING_BASES:
        _READING_BASES.move_to_end(key)
        return _READING_BASES[key]
    basis = _READING_BASES[key] = two_covariance_basis(stats)
    while len(_READING_BASES) > _READING_BASES_KEPT:
        _READING_BASES.popitem(last=False)
    return basis


def held_out_background_choices(
    features: torch.Tensor, labels: torch.Tensor, shrinkage: float | None = None
) -> tuple:
    """``(λ, inductive, query)``: the shrinkage that held-out base classes prefer
    (:func:`~probfsl.inference.background_shrinkage.select_shrinkage`) and the readings
    (:class:`~probfsl.inference.open_temperature.OpenReading`: blends and odds scale)
    chosen on their open-set episodes, inductive and in the queries' frame
    (:func:`~probfsl.inference.open_temperature.select_open_readings`). All are seeded
    functions of ``features`` and ``labels``, so the last few are kept by a digest of
    them and handed back for the same base classes (the same numbers, computed once).
    ``shrinkage``: ``select_shrinkage(features, labels)`` where the caller has it already
    (it is not computed again).

    They are also kept on disk beside the choices of ``preset="auto"``
    (:mod:`probfsl.tuning_cache`, under the same digest and the probfsl version), so that
    later runs on the same base classes, at other shots or with other methods of the same
    preprocessing, read them back: at D = 2,048 they cost minutes on one core."""
    from probfsl.inference.background_shrinkage import select_shrinkage
    from probfsl.inference.open_temperature import select_open_readings

    key = _digest(features, labels)
    if key in _BACKGROUND_CHOICES:
        _BACKGROUND_CHOICES.move_to_end(key)
        return _BACKGROUND_CHOICES[key]
    if shrinkage is None:
        shrinkage = select_shrinkage(features, labels)
    stored_key = _stored_choices_key(key, features, shrinkage)
    choices = _stored_choices(stored_key)
    if choices is None:
        choices = (shrinkage, *select_open_readings(features, labels, shrinkage, (False, True)))
        if all(math.isfinite(r.log_loss) for r in choices[1:]):  # not the cheap fallback
            _store_choices(stored_key, choices)
    _BACKGROUND_CHOICES[key] = choices
    while len(_BACKGROUND_CHOICES) > _BACKGROUND_CHOICES_KEPT:
        _BACKGROUND_CHOICES.popitem(last=False)
    return choices


def _stored_choices_key(digest: str, features: torch.Tensor, shrinkage: float) -> dict:
    """The disk-cache key of the held-out choices of base features of ``digest`` at the
    shrinkage λ ``shrinkage``: the digest, λ, the probfsl version, the grids the choices
    are made on and how the held-out log loss is compared (in the log domain; choices
    stored before, which compared the losses themselves and so could tie where they
    underflow, are not read back)."""
    from probfsl import __version__
    from probfsl.inference import background_shrinkage, open_temperature

    return {
        "kind": "background",
        "method": "open-set background",
        "shape": list(features.shape),
        "data": digest,
        "shrinkage": shrinkage,
        "probfsl": __version__,
        "shrinkage_grid": list(background_shrinkage.GRID),
        "folds": background_shrinkage.FOLDS,
        "mix_grid": list(open_temperature.MIX_GRID),
        "scale_grid": list(open_temperature.GRID),
        "loss": "log domain",
        "tasks": open_temperature.SELECTION_TASKS,
    }


def _stored_choices(key: dict) -> tuple | None:
    """The choices stored under ``key`` (``None`` where there are none or they cannot be
    read)."""
    from probfsl import tuning_cache
    from probfsl.inference.open_temperature import OpenReading

    stored = tuning_cache.load(key)
    if stored is None:
        return None
    try:
        choices = (float(stored["shrinkage"]), *(OpenReading(**r) for r in stored["readings"]))
    except (KeyError, TypeError, ValueError):
        return None
    if len(choices) != 3 or choices[0] != key["shrinkage"]:
        return None
    # choices made on held-out classes only: a fallback stored by an older version may
    # differ from today's (:data:`~probfsl.inference.open_temperature.UNSPLIT_READING`)
    return choices if all(math.isfinite(r.log_loss) for r in choices[1:]) else None


def _store_choices(key: dict, choices: tuple) -> None:
    from probfsl import tuning_cache

    shrinkage, *readings = choices
    value = {"shrinkage": shrinkage, "readings": [r._asdict() for r in readings]}
    tuning_cache.store(key, value)


@dataclass
class SharedBackground:
    """What :meth:`OpenSetBackground.fit_background` learns from preprocessed base
    features and labels alone: the shrinkage λ, the background statistics (mean, within-
    and between-class covariance, shrunk by λ) and, once the open-set posterior first
    needs them, the held-out choices of :func:`held_out_background_choices`. Estimators
    fitted on the same base features inside :func:`shared_backgrounds` hold the same
    object (the choices are then made once for all of them)."""

    shrinkage: float
    mean: torch.Tensor
    within: torch.Tensor
    between: torch.Tensor
    features: torch.Tensor
    labels: torch.Tensor
    choices: tuple | None = None

    def held_out_choices(self) -> tuple:
        """:func:`held_out_background_choices` of the base features, made at the first
        call (with the λ already chosen) and kept."""
        if self.choices is None:
            self.choices = held_out_background_choices(self.features, self.labels, self.shrinkage)
        return self.choices


@dataclass
class _SharedScope:
    """What one :func:`shared_backgrounds` block keeps: the backgrounds by the digest of
    their base features and labels and their device, and the last few readings of tasks
    (:func:`shared_reading`: their inputs, way, frame and the reading, most recent last;
    :data:`_SHARED_READINGS_KEPT` of them)."""

    backgrounds: dict[tuple[str, str], SharedBackground] = field(default_factory=dict)
    readings: list[tuple] = field(default_factory=list)


#: the innermost :func:`shared_backgrounds` block's :class:`_SharedScope` (``None`` outside
#: any block)
_SHARED_BACKGROUNDS: ContextVar[_SharedScope | None] = ContextVar(
    "probfsl_shared_backgrounds", default=None
)
#: readings a block keeps (each holds its tasks and their projection, about three times
#: the query tensor): the candidates of a search read the same episodes one after the other
_SHARED_READINGS_KEPT = 1


@contextmanager
def shared_backgrounds() -> Iterator[None]:
    """Inside the block, estimators whose ``fit_base`` hands
    :meth:`OpenSetBackground.fit_background` the same preprocessed base features and
    labels (bytes, dtype, shape and device) share one :class:`SharedBackground`: the
    shrinkage λ chosen on class folds, the covariances and the held-out choices are
    computed once instead of once per estimator. They are deterministic functions of
    those tensors, so every estimator gets the numbers a fresh fit gives.

    A search on base-class episodes (:func:`probfsl.tuning.tune`,
    :func:`probfsl.tuning.auto_preset`) fits every candidate on the same base classes
    with the same preprocessing, so it runs inside one block; the backgrounds are
    forgotten when the block ends (a block inside another uses the outer one's). Keys
    are digests of the tensors' contents, so data of another data set, another
    preprocessing, dtype or device never meet a background fitted on other data.

    Likewise the candidates read the same episodes under the same background: the
    projection of their support and queries onto the background's basis
    (:class:`~probfsl.inference.background.TwoCovarianceReading`) is shared
    (:func:`shared_reading`) where the tensors are equal."""
    if _SHARED_BACKGROUNDS.get() is not None:
        yield
        return
    token = _SHARED_BACKGROUNDS.set(_SharedScope())
    try:
        yield
    finally:
        _SHARED_BACKGROUNDS.reset(token)


def fit_shared_background(features: torch.Tensor, labels: torch.Tensor) -> SharedBackground:
    """The :class:`SharedBackground` of preprocessed base ``features`` [N, D] and
    ``labels`` [N] (on the features' device): the one fitted on equal tensors earlier in
    the current :func:`shared_backgrounds` block, else a fresh fit (kept in the block,
    where there is one)."""
    from probfsl.inference.background import fit_background
    from probfsl.inference.background_shrinkage import select_shrinkage

    scope = _SHARED_BACKGROUNDS.get()
    key = None
    if scope is not None:
        key = (_digest(features, labels), str(features.device))
        if key in scope.backgrounds:
            return scope.backgrounds[key]
    shrinkage = select_shrinkage(features, labels)
    stats = fit_background(features, labels, shrinkage)
    background = SharedBackground(shrinkage, *stats, features, labels)
    if scope is not None:
        scope.backgrounds[key] = background
    return background


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same values in the same dtype, shape and device."""
    return a is b or (
        a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    )


def shared_reading(
    support: torch.Tensor,
    support_labels: torch.Tensor,
    query: torch.Tensor,
    way: int,
    stats: BackgroundStats,
    query_centring: bool,
    basis: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> TwoCovarianceReading:
    """``TwoCovarianceReading(support, support_labels, query, way, stats, query_centring,
    basis)``; inside a :func:`shared_backgrounds` block, a copy of the reading made there
    from equal tensors (the tasks, the background's mean and the basis: the reading
    reads nothing else of ``stats``), whose projections are the same numbers. The
    comparison is one look per call, none inside a method's iterations."""
    from probfsl.inference.background import TwoCovarianceReading

    scope = _SHARED_BACKGROUNDS.get()
    if scope is None:
        return TwoCovarianceReading(
            support, support_labels, query, way, stats, query_centring, basis
        )
    inputs = (support, support_labels, query, stats.mean, *basis)
    for i, (kept, kept_way, kept_frame, reading) in enumerate(scope.readings):
        if (kept_way, kept_frame) == (way, query_centring) and all(
            _equal(a, b) for a, b in zip(inputs, kept, strict=True)
        ):
            scope.readings.append(scope.readings.pop(i))
            return reading.copy()
    reading = TwoCovarianceReading(
        support, support_labels, query, way, stats, query_centring, basis
    )
    scope.readings.append((inputs, way, query_centring, reading.copy()))
    del scope.readings[:-_SHARED_READINGS_KEPT]
    return reading


class OpenSetBackground:
    """Mixin: the background density of the open-set posterior (:meth:`predict_proba_open`).

    ``fit_base`` calls :meth:`fit_background` with the base features in the space the
    method classifies in (after its preprocessing), which stores :data:`BACKGROUND`.
    The inductive posterior (:meth:`inductive_open`) reads the method's features through
    the two-covariance model of the base classes (:meth:`open_reading`): the last column is
    P(z = 0 | x) with prior π_0 = ``open_prior``, its log-odds scaled by
    ``background_odds_scale_`` and shifted by ``background_odds_shift_``
    (:mod:`probfsl.inference.open_temperature`), and the known columns are the method's
    own closed-set probabilities times 1 - P(z = 0 | x), so their argmax is
    :meth:`predict_proba`'s.
    """

    open_prior: float = 0.5

    @property
    def infers_open_fraction(self) -> bool:
        """Whether P(open) infers the open fraction π_0 of each task (a transductive
        mixture with the background, ``open_prior`` the mean of π_0's prior) rather than
        reading ``open_prior`` as π_0 (the inductive posterior, :meth:`inductive_open`)."""
        return False

    #: the names of the choices made on held-out base classes (:meth:`_choose_background`)
    _CHOICES = (
        "background_within_mix_",
        "background_between_mix_",
        "background_odds_scale_",
        "background_odds_shift_",
        "background_query_within_mix_",
        "background_query_between_mix_",
        "background_query_odds_scale_",
        "background_query_odds_shift_",
        "background_held_out_",
    )

    def fit_background(self, features: torch.Tensor, labels: torch.Tensor) -> None:
        """Store the background statistics of preprocessed base ``features`` [N, D], their
        covariances shrunk by the λ that held-out base classes prefer
        (:func:`~probfsl.inference.background_shrinkage.select_shrinkage`), kept as
        ``background_shrinkage_``, and, learnt on episodes of held-out base classes
        (:func:`held_out_background_choices`), the isotropic blends of the covariances and
        the scale of the open log-odds, inductive (``background_within_mix_``,
        ``background_between_mix_``, ``background_odds_scale_``, ``background_odds_shift_``)
        and in the queries' frame (``background_query_*``). These choices cost seconds on
        wide features and serve the open-set posterior alone, so they are made when it
        first needs them (or when the estimator is saved), from the base features kept
        until then; the numbers are the same either way.

        Fewer than :data:`MIN_BACKGROUND_CLASSES` base classes store no background: their
        between-class covariance is zero, so a new class's predictive would be that of the
        base classes' own mean and P(open) the prior ``open_prior`` for every query;
        :meth:`predict_proba_open` then says so."""
        labels = labels.to(features.device)
        for name in (*self._CHOICES, *BACKGROUND.attributes, "_background_base"):
            self.__dict__.pop(name, None)  # a previous fit's background and choices
        if int(labels.unique().numel()) < MIN_BACKGROUND_CLASSES:
            return
        background = fit_shared_background(features, labels)
        self._background_base = background
        self.background_shrinkage_ = background.shrinkage
        self.background_mean_ = background.mean
        self.background_within_ = background.within
        self.background_between_ = background.between

    def _choose_background(self) -> None:
        """Make the held-out choices of :meth:`fit_background` if they are still due."""
        base = self.__dict__.pop("_background_base", None)
        if base is None:  # made already, or loaded (older files: none, read as 0, 0, 1)
            return
        _, inductive, query = base.held_out_choices()
        self.background_within_mix_ = inductive.within_mix
        self.background_between_mix_ = inductive.between_mix
        self.background_odds_scale_ = inductive.odds_scale
        self.background_odds_shift_ = inductive.odds_shift
        self.background_query_within_mix_ = query.within_mix
        self.background_query_between_mix_ = query.between_mix
        self.background_query_odds_scale_ = query.odds_scale
        self.background_query_odds_shift_ = query.odds_shift
        self.background_held_out_ = math.isfinite(inductive.log_loss)

    def open_background_note(self) -> str | None:
        """A one-line notice where the open-set posterior could not be tuned on held-out
        base classes (too few of them to split: the covariances read partly isotropic and
        P(open) uncalibrated, :data:`~probfsl.inference.open_temperature.UNSPLIT_READING`);
        ``None`` where it was, where there is no background, and for files saved before
        the flag."""
        if getattr(self, "background_mean_", None) is None:
            return None
        self._choose_background()
        if getattr(self, "background_held_out_", True):
            return None
        return (
            "P(open): the base classes are too few to hold some out (about nine are "
            "needed), so its background was not tuned on held-out classes: covariances "
            "read half (within-class) and fully (between-class) isotropic, odds unscaled "
            "(ECE-open may be high)"
        )

    def fitted_state(self) -> dict[str, Any]:
        """The fitted attributes, the held-out choices made first (:meth:`fit_background`)."""
        self._choose_background()
        return super().fitted_state()

    def background_stats(self, reference: torch.Tensor, query_centring: bool = False):
        """The fitted :class:`~probfsl.inference.background.BackgroundStats`, blended as
        chosen for the inductive reading (``query_centring=True``: for the reading in the
        queries' frame, :class:`~probfsl.inference.background.TwoCovarianceReading`), in
        the dtype and on the device of ``reference``; ``ValueError`` without base
        classes."""
        from probfsl.inference.background import BackgroundStats

        if getattr(self, "background_mean_", None) is None:
            raise ValueError(
                f"{type(self).__name__}.predict_proba_open needs base classes (at least "
                f"{MIN_BACKGROUND_CLASSES}): its background density, a new class's predictive, "
                "is learnt from the spread of their class means; call fit_base(features, "
                "labels) with them first"
            )
        self._choose_background()
        prefix = "background_query_" if query_centring else "background_"
        stats = BackgroundStats(
            self.background_mean_, self.background_within_, self.background_between_
        ).to(reference)
        return stats.blended(  # 0, 0 for files saved before the blends were chosen
            getattr(self, prefix + "within_mix_", 0.0),
            getattr(self, prefix + "between_mix_", 0.0),
        )

    def open_reading(
        self,
        support: torch.Tensor,
        support_labels: torch.Tensor,
        query: torch.Tensor,
        way: int,
        query_centring: bool = False,
    ):
        """The :class:`~probfsl.inference.background.TwoCovarianceReading` of a batch of
        preprocessed tasks under the fitted background (:meth:`background_stats`, blended
        for the frame ``query_centring`` names), its D x D basis computed once for these
        statistics (:func:`reading_basis`). Its background is the base classes'; in the
        queries' frame the transductive methods infer the task's own after their
        iterations (:meth:`final_open`)."""
        stats = self.background_stats(query, query_centring)
        basis = reading_basis(stats)
        return shared_reading(support, support_labels, query, way, stats, query_centring, basis)

    def final_open(self, reading, proba: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A transductive method's converged query responsibilities ``proba`` [T, Q, C + 1]
        (C closed components, the background last) read last under the background: (the
        closed components' shares [T, Q, C], the log-odds of P(open) [T, Q]), kept apart
        so that both stay exact where the probabilities round to 0 or 1
        (:func:`~probfsl.inference.background.reread_open`; :meth:`tempered_open` joins
        them).

        One more mean-field coordinate update, the class factors fixed (Bishop, PRML
        §10.2.1; Winn & Bishop, JMLR 2005): q(π_0), then the open responsibilities under
        the contrast of ``reading`` (:meth:`open_reading`, whose base-class background the
        iterations used). In the queries' frame the task's own background is inferred
        first: q(m_0), the background's mean, from the queries
        (:meth:`~probfsl.inference.background.TwoCovarianceReading.infer_background_mean`,
        the odds scale ``background_query_odds_scale_``, ``open_prior``). The known
        classes' statistics are thus those of the iterations with the base-class
        background: the open queries that the inferred background reads as closed do not
        pull them."""
        from probfsl.inference.background import reread_open

        if reading.query_centring:
            scale, _ = self.held_out_calibration(query_centring=True)  # chosen if still due
            reading.infer_background_mean(scale, self.open_prior)
        return reread_open(proba, reading.open_log_odds().to(proba), self.open_prior)

    def tempered_open(self, episodes: Episodes) -> torch.Tensor:
        """A transductive method's ``[T, Q, K+1]`` for the queries of ``episodes``, from the
        known classes' shares [T, Q, K] and the log-odds of P(open) [T, Q] of its
        ``inferred_open``: the log-odds averaged over each query's ``open_neighbours``
        nearest queries, then scaled by a and moved by b, those of :meth:`open_calibration`
        (:meth:`open_log_odds`; a temperature, Guo et al., ICML 2017, and Platt's
        intercept, 1999), the known columns 1 - P(open) in the ratios of the shares
        (:func:`~probfsl.inference.vb_mixture_open.open_columns`), whose argmax they keep.
        ``open_neighbours`` = 5 raised the AUROC by 0.9 to 1.8 points on the built-in sets
        but left P(open) less well calibrated, so the methods default to 0
        (docs/methods/open-set.md)."""
        from probfsl.inference.vb_mixture_open import open_columns

        known, log_odds = self.inferred_open(episodes)
        a, b = self.open_calibration()
        return open_columns(known, a * self.open_log_odds(log_odds, episodes.query) + b)

    def open_log_odds(self, log_odds: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
        """The log-odds of P(open) as inferred, ``log_odds`` [T, Q], averaged over each
        query's ``open_neighbours`` nearest queries in ``query`` [T, Q, D]
        (:func:`~probfsl.inference.open_neighbours.neighbour_averaged_log_odds`; one step of
        label propagation, Zhou et al., NIPS 2004): what ``open_scale`` and ``open_shift``
        apply to."""
        from probfsl.inference.open_neighbours import neighbour_averaged_log_odds

        return neighbour_averaged_log_odds(log_odds, query, int(self.open_neighbours))

    def inferred_open_log_odds(self, episodes: Episodes) -> torch.Tensor:
        """The log-odds [T, Q] that ``open_scale`` and ``open_shift`` apply to, for the
        queries of ``episodes`` (:meth:`open_log_odds` of a transductive method's
        ``inferred_open``): what the search learns the scale on
        (:func:`probfsl.tuning.learn_open_calibration`)."""
        return self.open_log_odds(self.inferred_open(episodes)[1], episodes.query)

    def open_calibration(self) -> tuple[float, float]:
        """(a, b) of :meth:`tempered_open`. The held-out base classes give the contrast's
        log-odds in the estimator's ``open_frame`` a scale a_h and a shift b_h
        (:meth:`held_out_calibration`), so a bias of β = b_h / a_h nats; a is
        ``open_scale``, or a_h where that is ``None`` (the default), and b is
        ``open_shift``, or a β where that is ``None``: the scale applies to the log-odds
        with the held-out bias taken out, σ(a (logit P(open) + β)). ``open_scale=1`` with
        ``open_shift=0`` leaves P(open) as inferred."""
        scale, shift = self.held_out_calibration()
        given_scale = getattr(self, "open_scale", None)
        given_shift = getattr(self, "open_shift", None)
        a = scale if given_scale is None else float(given_scale)
        b = a * shift / scale if given_shift is None else float(given_shift)
        return a, b

    @property
    def in_queries_frame(self) -> bool:
        """Whether ``open_frame`` names the queries' frame (the task re-centred on its
        queries' mean; ``query_centring`` of
        :class:`~probfsl.inference.background.TwoCovarianceReading`); estimators without
        the hyperparameter, and files saved before it, read the base frame."""
        return getattr(self, "open_frame", "base") == "queries"

    def held_out_calibration(self, query_centring: bool | None = None) -> tuple[float, float]:
        """(a_h, b_h): the scale and shift of the contrast's log-odds that held-out base
        classes give in the estimator's ``open_frame``, or in the queries' frame where
        ``query_centring`` says so (``background_odds_scale_`` and
        ``background_odds_shift_``, or their ``background_query_*`` counterparts, chosen
        by :meth:`fit_background`; 1 and 0 for files saved before them)."""
        self._choose_background()
        if query_centring is None:
            query_centring = self.in_queries_frame
        prefix = "background_query_" if query_centring else "background_"
        return (
            float(getattr(self, prefix + "odds_scale_", 1.0)),
            float(getattr(self, prefix + "odds_shift_", 0.0)),
        )

    def inductive_open(
        self,
        episodes: Episodes,
        proba: torch.Tensor,
        support: torch.Tensor,
        query: torch.Tensor,
        query_centring: bool | None = None,
    ) -> torch.Tensor:
        """``[T, Q, K+1]`` from the closed-set ``proba`` and the preprocessed ``support``
        and ``query`` features (the class docstring), in the estimator's ``open_frame``
        unless ``query_centring`` names the frame: in the queries' frame the contrast is
        read with that frame's held-out blends, scale and shift (each task's P(open) then
        depends on its queries' mean). P(open) is σ of :meth:`inductive_open_log_odds`."""
        from probfsl.inference.background import attach_open

        log_odds = self.inductive_open_log_odds(episodes, support, query, query_centring)
        return attach_open(proba, torch.sigmoid(log_odds).to(proba))

    def inductive_open_log_odds(
        self,
        episodes: Episodes,
        support: torch.Tensor,
        query: torch.Tensor,
        query_centring: bool | None = None,
    ) -> torch.Tensor:
        """The log-odds [T, Q] of the inductive P(open) of :meth:`inductive_open` (same
        arguments, without ``proba``; :func:`~probfsl.inference.background.inductive_log_odds`)."""
        from probfsl.inference.background import inductive_log_odds

        if query_centring is None:
            query_centring = self.in_queries_frame
        reading = self.open_reading(
            support, episodes.support_labels, query, episodes.way, query_centring
        )
        class_ll, background_ll = reading.class_log_lik(), reading.background_log_lik()
        scale, shift = self.held_out_calibration(query_centring)
        return inductive_log_odds(class_ll, background_ll, self.open_prior, scale, shift)


class BaseMeanCentering:
    """Mixin for estimators that centre features on the base-class mean (SimpleShot).

    The estimator sets ``self.center``; ``fit_base`` stores ``base_mean_`` (the mean
    of all base features) and :meth:`centring_mean` returns it, or ``None`` when
    ``center`` is off.
    """

    center: bool = True

    @property
    def needs_base(self) -> bool:
        return self.center

    def fit_base(self, features: Any, labels: Any) -> Self:
        """Store the mean of the base ``features`` [N, D] (tensor or NumPy array)."""
        features, labels = check_base(features, labels)
        self.base_mean_ = features.mean(0)
        if isinstance(self, OpenSetBackground):
            self.fit_background(center_and_normalize(features, self.centring_mean()), labels)
        return self

    def centring_mean(self) -> torch.Tensor | None:
        """The base mean to subtract, ``None`` without centring; ``ValueError`` if not fitted."""
        if not self.center:
            return None
        if getattr(self, "base_mean_", None) is None:
            raise ValueError("center=True needs base features: call fit_base first")
        return self.base_mean_

    def checked_centring_mean(self, episodes: Episodes) -> torch.Tensor | None:
        """:meth:`centring_mean` after :func:`~probfsl.validation.check_episodes` of
        ``episodes`` (with the base width when centring, so that tasks wider or narrower
        than the base features are a ``ValueError``, not a broadcasting error)."""
        mean = self.centring_mean()
        check_episodes(episodes, dim=None if mean is None else mean.shape[0])
        return mean


def episodes_from_arrays(
    support: Any, support_labels: Any, query: Any
) -> tuple[Episodes, torch.Tensor, bool]:
    """An :class:`Episodes` batch from plain arrays or tensors (see
    :meth:`FewShotClassifier.fit_predict`), each task's class values ``[T, K]`` (sorted)
    and whether the input was a single task.

    Task-local labels are the positions of the support labels among their task's sorted
    distinct values (``searchsorted``, batched); ``ValueError`` when the tasks of a batch
    do not have the same number of classes or the labels do not fit the support (the
    query is checked with the whole batch by the estimator's ``predict_proba``).
    """
    if isinstance(support, Episodes):
        raise TypeError("fit_predict takes arrays; predict an Episodes batch with predict()")
    support = as_float_tensor(as_user_array(support, "support"), "support")
    query = as_float_tensor(as_user_array(query, "query"), "query")
    support_labels = as_user_array(support_labels, "support_labels", features=False)
    if support.ndim not in (2, 3) or query.ndim != support.ndim:
        raise ValueError(
            f"support and query must both be [n, D] (one task) or [T, n, D], got shapes "
            f"{tuple(support.shape)} and {tuple(query.shape)}"
        )
    single = support.ndim == 2
    if single:
        support, query = support.unsqueeze(0), query.unsqueeze(0)
    labels = as_label_tensor(support_labels, "support_labels", device=support.device)
    given = tuple(labels.shape)
    labels = labels.unsqueeze(0) if single and labels.ndim == 1 else labels
    if labels.shape != support.shape[:2]:
        raise ValueError(
            f"support_labels must be {list(support.shape[:2])[single:]} (one per support "
            f"row), got shape {given}"
        )
    ordered = labels.sort(-1).values
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    counts = first.sum(-1)
    if bool((counts != counts[0]).any()):
        raise ValueError(
            "every task of a batch must have the same number of distinct support labels, "
            f"got {sorted(set(counts.tolist()))}"
        )
    classes = ordered[first].reshape(labels.shape[0], -1)  # [T, K]
    local = torch.searchsorted(classes, labels)
    n_tasks, n_query = query.shape[:2]
    zeros = torch.zeros(n_tasks, n_query, dtype=torch.long, device=query.device)
    index = torch.arange(labels.shape[1], device=labels.device).expand_as(labels)
    episodes = Episodes(support, local, query, zeros, classes, index, zeros)
    return episodes, classes, single


def encode_task_labels(support_labels: Any) -> tuple[Any, np.ndarray | None]:
    """Support labels ready for :func:`episodes_from_arrays`, and their values.

    Integer labels (tensors, and arrays or sequences of integers or whole-number floats)
    are returned as they are, with ``None``: :func:`episodes_from_arrays` handles them
    (on their device, without a copy to the host). Labels of any other type (strings,
    booleans, objects; a pandas ``Categorical`` or Series is taken as its values) become
    ``int64`` positions among each task's sorted distinct values, returned with those
    values ``[T, K]`` (``T = 1`` for one task's ``[n]`` labels), the dtype of
    ``numpy.unique`` of them.

    ``TypeError`` for labels that cannot be sorted against each other (say strings mixed
    with numbers) or that hold ``None``; ``ValueError`` for labels that are not ``[n]`` or
    ``[T, n]``, or tasks of a batch with different numbers of classes.
    """
    if isinstance(support_labels, torch.Tensor):
        return support_labels, None
    labels = as_user_array(support_labels, "support_labels", features=False)
    if isinstance(labels, (list, tuple)):
        given = labels
        labels = np.asarray(given)
        if labels.dtype.kind in "USO":
            items = np.asarray(given, dtype=object)
            if not all(isinstance(v, str) for v in items.ravel()):
                labels = items  # mixed types: keep each value as it is, not as text
    elif not isinstance(labels, np.ndarray):
        labels = np.asarray(labels)
    if labels.dtype.kind in "iuf":
        return labels, None
    if labels.ndim not in (1, 2) or labels.shape[-1] == 0:
        raise ValueError(
            f"support_labels must be [n] (one task) or [T, n] (a batch), got shape {labels.shape}"
        )
    rows = labels.reshape(-1, labels.shape[-1])
    if labels.dtype.kind == "O" and any(v is None for v in rows.ravel()):
        raise TypeError("support_labels contains None: every support row needs a label")
    values, codes = [], []
    for row in rows:
        try:
            distinct, inverse = np.unique(row, return_inverse=True)
        except TypeError as err:
            raise TypeError(
                "support_labels must be values that sort against each other (all strings, "
                f"or all numbers, ...): {err}"
            ) from None
        values.append(distinct)
        codes.append(inverse.reshape(-1))
    counts = sorted({len(v) for v in values})
    if len(counts) > 1:
        raise ValueError(
            "every task of a batch must have the same number of distinct support labels, "
            f"got {counts}"
        )
    return np.stack(codes).reshape(labels.shape).astype(np.int64), np.stack(values)


def _task_arrays(
    support: Any, support_labels: Any, query: Any
) -> tuple[Episodes, torch.Tensor, np.ndarray | None, bool]:
    """:func:`episodes_from_arrays` after :func:`encode_task_labels`: the episodes, their
    class values as integers ``[T, K]``, the caller's label values ``[T, K]`` (``None``
    for integer labels, which ``classes`` then holds) and whether it was one task."""
    if isinstance(support, Episodes):
        raise TypeError("fit_predict takes arrays; predict an Episodes batch with predict()")
    labels, values = encode_task_labels(support_labels)
    episodes, classes, single = episodes_from_arrays(support, labels, query)
    return episodes, classes, values, single
