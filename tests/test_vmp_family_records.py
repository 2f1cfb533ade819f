"""One record per family (docs/design/vmp.md §7.0): every family VMP knows is described by
its record in ``probfsl/inference/vmp/families/``, the list of supported forms is formed
from the records, and no other module of VMP compares a site's family with a name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import probfsl.inference.vmp as vmp
from probfsl.inference.vmp import supported
from probfsl.inference.vmp.family import BY_CLASS, REGISTRY, Family

VMP_DIR = Path(vmp.__file__).parent


def _overrides(record: Family, method: str) -> bool:
    return getattr(type(record), method) is not getattr(Family, method)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_family_has_a_complete_record(name):
    record = REGISTRY[name]
    assert record.name == name and BY_CLASS[record.pyro_class] is record
    assert inspect.isclass(record.pyro_class)
    for key, parents in record.roles.items():
        assert parents and set(parents) <= set(REGISTRY), (key, parents)
    for key, parent in record.conjugate.items():
        assert parent in record.roles[key], (key, parent)
    if record.linear_parameter is not None:
        assert record.linear_parameter in record.roles
    if record.roles:
        # a child's messages and bound term: its coefficients (a linear child) or its own
        linear = record.linear_parameter is not None
        assert linear or (_overrides(record, "message") and _overrides(record, "loglik"))
        assert record.forms, "a family with parents describes its forms"
    if not record.observed_only:
        # a factor: its block, the block's parameters and the posterior they give
        assert record.block is not None and record.fields
        assert _overrides(record, "posterior")
    assert name in vmp.SUPPORTED


def test_starting_values_are_the_records():
    """A start may give the mean of every latent family but the labels (given as
    probabilities), and ``"prior"`` draws the Gaussian families' means."""
    latent = {n for n, r in REGISTRY.items() if not r.observed_only and not r.labels}
    assert {n for n, r in REGISTRY.items() if r.takes_mean()} == latent
    gaussian = {n for n, r in REGISTRY.items() if r.gaussian}
    assert {n for n, r in REGISTRY.items() if r.draws_start()} == gaussian


def _role_pairs() -> list[tuple[str, str, str]]:
    """(family, parameter, parent family) of every role of every record."""
    return [
        (name, key, parent)
        for name, record in REGISTRY.items()
        for key, parents in record.roles.items()
        for parent in parents
    ]


def test_supported_is_formed_from_the_records():
    assert vmp.SUPPORTED is supported.SUPPORTED
    assert supported.SUPPORTED == supported.supported()
    phrases = list(dict.fromkeys(p for r in REGISTRY.values() for p in r.forms))
    text = supported.SUPPORTED
    assert text.startswith(phrases[0])
    at = [text.index(p) for p in phrases]
    assert at == sorted(at), "the records' phrases, in the registry's order"
    latent = [n for n, r in REGISTRY.items() if not r.observed_only]
    fixed = text.split("; ")[-2]
    assert fixed.endswith("with fixed parameters")
    assert all(n in fixed for n in latent)
    points = text.split("; ")[-1]
    assert all((n in points) == REGISTRY[n].can_be_point() for n in REGISTRY)


@pytest.mark.parametrize("pair", _role_pairs(), ids="-".join)
def test_every_role_is_a_supported_form(pair):
    """Each (child parameter <- parent) pair of the records is in the family's words."""
    name, key, parent = pair
    record = REGISTRY[name]
    words = " ".join(p for p in record.forms if name in p)
    assert words, f"no phrase of {name}'s forms names it"
    assert key in words or record.model_names.get(key, key) in words
    assert parent in words


def _family_comparisons(tree: ast.AST, names: set[str]) -> list[str]:
    """The comparisons with a family's name as a string constant (``s.family == "Gamma"``,
    ``family in ("Normal", ...)``) and the literal tables of family names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in (node.left, *node.comparators):
                consts = [n.value for n in ast.walk(side) if isinstance(n, ast.Constant)]
                if any(c in names for c in consts):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
                    break
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            values = [e.value for e in node.elts if isinstance(e, ast.Constant)]
            if len(values) >= 2 and len(values) == len(node.elts) and set(values) <= names:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_records_branches_on_a_family_name():
    names = set(REGISTRY)
    offenders = {}
    for path in sorted(VMP_DIR.glob("*.py")):
        if path.name == "family.py":
            continue
        found = _family_comparisons(ast.parse(path.read_text()), names)
        if found:
            offenders[path.name] = found
    assert not offenders


def test_the_scan_finds_a_branch_on_a_family_name():
    names = set(REGISTRY)
    code = 'if s.family == "Gamma":\n    pass\nMEANS = ("Normal", "Beta")\nx = a in ("Wishart",)\n'
    assert len(_family_comparisons(ast.parse(code), names)) == 3
    assert not _family_comparisons(ast.parse('if k == "logits":\n    pass\n'), names)


def test_the_docs_list_of_supported_forms_names_every_family():
    """Every family with supported forms has a line in the docs' list a refusal points to."""
    import re
    from pathlib import Path

    from probfsl.inference.vmp.family import REGISTRY

    text = (Path(__file__).parents[1] / "docs" / "modelling.md").read_text()
    section = text.split("## Supported forms", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(\w+)`", section))
    missing = [name for name, record in REGISTRY.items() if record.forms and name not in named]
    assert not missing, f"docs/modelling.md#supported-forms lacks {missing}"
