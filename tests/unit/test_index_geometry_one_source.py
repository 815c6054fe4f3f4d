"""The shared index's geometry has one definition, kvd_proto/index_layout.py: the Python twins
(kvd_proto/native.py) take every meta-word bit and the slot -> offset rule from it, and the
compiled loops (kvd_proto/_native.c, _lookups.h, _steps.c), which keep inline copies for speed, hold the same values.
A change to the layout that misses the C file fails here, not as an engine reading the wrong
key length out of a daemon's index."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvd_proto import index_layout as layout

ROOT = Path(__file__).resolve().parents[2]
# The compiled index code: its defines and struct in _lookups.h, the loops in the .c files.
C_SOURCE = "".join((ROOT / "kvd_proto" / name).read_text()
                   for name in ("_lookups.h", "_native.c", "_steps.c"))
NATIVE_PY = ROOT / "kvd_proto" / "native.py"

# A meta word in the C file: a local read of one (`w`, `word`) or the array itself.
WORD = r"(?:\bw\b|\bword\b|g->meta\[\w+\])"


def _ints(pattern: str) -> list[tuple[int, ...]]:
    """Every match of `pattern` in the C file, its groups as integers (decimal or 0x)."""
    found = [tuple(int(g, 0) for g in m.groups()) for m in re.finditer(pattern, C_SOURCE)]
    assert found, f"_native.c no longer has {pattern!r}: update this test with the C code"
    return found


def _c_expression(function: str) -> str:
    """The returned expression of a one-line static inline function of the C file."""
    match = re.search(rf"\b{function}\([^)]*\)\s*\{{\s*return ([^;]+);\s*\}}", C_SOURCE)
    assert match, f"_native.c no longer has the one-line {function}(): update this test"
    return match.group(1)


def _evaluate(expression: str, **values: int) -> int:
    """A C integer expression over unsigned operands, evaluated as Python (`/` floors)."""
    expression = expression.replace("g->", "").replace("/", "//")
    assert re.fullmatch(r"[\w\s()+*%/|&<>~-]+", expression), expression
    return eval(expression, {"__builtins__": {}}, values)   # checked just above


@pytest.mark.parametrize("name", ["MAX_PROBE", "STATE_FREE", "STATE_STORING", "STATE_READY"])
def test_the_c_defines_equal_the_layout(name: str) -> None:
    assert _ints(rf"#define {name} (\w+)\n") == [(getattr(layout, name),)]


def test_the_c_meta_word_is_the_layouts() -> None:
    expression = _c_expression("meta_word")
    for state, key_len, generation in [(layout.STATE_READY, 17, 12345), (layout.STATE_FREE, 0, 1),
                                       (layout.STATE_STORING, layout.MAX_KEY_WIDTH, 2**54 - 1)]:
        assert _evaluate(expression, state=state, len=key_len, gen=generation) == \
            layout.meta_word(state, key_len, generation)


def test_the_c_reads_the_meta_words_fields_with_the_layouts_bits() -> None:
    assert {m for (m,) in _ints(rf"\(\s*{WORD}\s*&\s*(\w+)\s*\)")} == {layout.STATE_MASK}
    assert {m for (m,) in _ints(r"~\s*\(uint64_t\)\s*(\w+)")} == {layout.STATE_MASK}
    assert set(_ints(rf"\(\s*{WORD}\s*>>\s*(\w+)\s*\)\s*&\s*(\w+)")) == \
        {(layout.KEY_LEN_SHIFT, layout.KEY_LEN_MASK)}
    assert {s for (s,) in _ints(rf"\(\s*{WORD}\s*>>\s*(\w+)\s*\)\s*\+\s*1")} == \
        {layout.GENERATION_SHIFT}
    # No other shift of a meta word: every field the C code takes out of one is checked above.
    assert {s for (s,) in _ints(rf"{WORD}\s*>>\s*(\w+)")} == \
        {layout.KEY_LEN_SHIFT, layout.GENERATION_SHIFT}


def test_the_c_key_width_bound_is_the_layouts() -> None:
    assert {w for (w,) in _ints(r"\bwidth\s*>\s*(\w+)")} == {layout.MAX_KEY_WIDTH}


def test_the_c_slot_offset_is_the_layouts() -> None:
    expression = _c_expression("offset_of")
    per_extent, extent_bytes, stride = 16, 16 * 8192 + 4096, 8192
    for slot in (0, 1, 15, 16, 17, 999, 2**32 - 2):
        assert _evaluate(expression, slot=slot, per_extent=per_extent,
                         extent_bytes=extent_bytes, stride=stride) == \
            layout.slot_offset(slot, per_extent, extent_bytes, stride)


def test_the_python_twins_spell_no_meta_word_bit_of_their_own() -> None:
    """native.py shifts and masks with index_layout's names only (a literal there would be a
    second definition that nothing holds equal to the first)."""
    def integer(node: ast.expr) -> bool:
        return isinstance(node, ast.Constant) and type(node.value) is int

    tree = ast.parse(NATIVE_PY.read_text())
    bit_ops = (ast.BitAnd, ast.BitOr, ast.LShift, ast.RShift)
    literals = [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                if isinstance(node, ast.BinOp) and isinstance(node.op, bit_ops)
                and (integer(node.left) or integer(node.right))]
    literals += [f"line {node.lineno}: {ast.unparse(node)}" for node in ast.walk(tree)
                 if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Invert)
                 and integer(node.operand)]
    assert not literals, "native.py spells index geometry inline: " + "; ".join(literals)

