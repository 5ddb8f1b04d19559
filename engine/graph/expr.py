"""The whitelisting `expr` parser: Python's expression grammar, catalog ops only.

The text is parsed with `ast` (never eval, exec or compile) and every AST node
is checked against a short whitelist; anything else is refused with the piece
that offended. The result is the same op-form nodes a client could have
written, with generated ids for the intermediate values.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gradserve.engine.errors import ExprError, GraphError, UnknownOpError, did_you_mean, quoted
from gradserve.engine.graph.spec import NodeSpec
from gradserve.engine.rules import OPS, TRANSFORMS

_BINARY = {
    ast.Add: "add",
    ast.Sub: "sub",
    ast.Mult: "mul",
    ast.Div: "div",
    ast.Pow: "pow",
    ast.MatMult: "matmul",
}
_COMPARE = {ast.Lt: "lt", ast.LtE: "le", ast.Gt: "gt", ast.GtE: "ge", ast.Eq: "eq", ast.NotEq: "ne"}
_DESCRIBE = {
    ast.Attribute: "attribute access",
    ast.Subscript: "a subscript",
    ast.Lambda: "a lambda",
    ast.ListComp: "a comprehension",
    ast.SetComp: "a comprehension",
    ast.DictComp: "a comprehension",
    ast.GeneratorExp: "a comprehension",
    ast.Starred: "a starred argument",
    ast.BoolOp: "'and'/'or'",
    ast.IfExp: "a conditional",
    ast.Dict: "a dict",
    ast.Set: "a set",
    ast.JoinedStr: "an f-string",
    ast.NamedExpr: "':='",
    ast.Await: "await",
    ast.Yield: "yield",
    ast.YieldFrom: "yield",
}

Value = str | bool | int | float  # a reference (input or node id) or a number literal

# The most significant digits of an integer literal within int64, by base (-2**63
# included: 2**63 takes 22 octal and 64 binary digits).
_INT64_DIGITS = {"0x": 16, "0o": 22, "0b": 64}
_INT64_DECIMAL_DIGITS = 19

# JSON's spellings of Python's constants, for a hint where a literal is expected.
_JSON_CONSTANTS = {"true": "True", "false": "False", "null": "None"}


@dataclass
class Expansion:
    """What an `expr` node becomes: op-form nodes (the last carries the node's id), or an
    alias when the expression is just the name of another value."""

    nodes: list[NodeSpec]
    alias: str | None = None
    # Per node id: where its piece of the expression is (line, column, end line, end
    # column, as `ast` counts them, in the text as given), for errors that name it.
    spans: dict[str, Span] = field(default_factory=dict)


Span = tuple[int, int, int, int]


def piece_of(text: str, span: Span) -> str:
    """An error's pointer to a piece of an expression: `'x @ w' at column 5` (1-based; with
    its line when the text has several)."""
    line, col, end_line, end_col = span
    segment = (
        ast.get_source_segment(
            text,
            ast.Constant(
                None, lineno=line, col_offset=col, end_lineno=end_line, end_col_offset=end_col
            ),
        )
        or ""
    )
    where = f"line {line}, column {col + 1}" if "\n" in text else f"column {col + 1}"
    return f"{quoted(segment, 60)} at {where}"


# In text without strings, brackets and integer literals are found without the tokenizer
# (which costs more than the parse): an integer is digits not touching a name or a '.'.
_BRACKETS = re.compile(r"[()\[\]{}]")
_INTEGERS = re.compile(r"(?<![\w.])(?:0[xXoObB][0-9a-fA-F_]*|[0-9][0-9_]*)(?![\w.])")


def _scan_tokens(text: str) -> tuple[int, str | None]:
    """The deepest bracket nesting, and the first integer literal too long for int64 (or
    None): both are checked on the tokens, before `ast.parse` can choke on them."""
    depth = deepest = 0
    if text.isascii() and '"' not in text and "'" not in text and "#" not in text:
        for bracket in _BRACKETS.findall(text):
            if bracket in "([{":
                depth += 1
                deepest = max(deepest, depth)
            else:
                depth -= 1
        literal = next((m.group() for m in _INTEGERS.finditer(text) if _too_long(m.group())), None)
        return deepest, literal
    return _scan_with_tokenizer(text)


def _scan_with_tokenizer(text: str) -> tuple[int, str | None]:
    """`_scan_tokens` for any text, on Python's own tokens."""
    depth = deepest = 0
    too_long = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.OP and tok.string in "([{":
                depth += 1
                deepest = max(deepest, depth)
            elif tok.type == tokenize.OP and tok.string in ")]}":
                depth -= 1
            elif tok.type == tokenize.NUMBER and too_long is None and _too_long(tok.string):
                too_long = tok.string
    except (tokenize.TokenError, SyntaxError):
        pass  # ast.parse reports the syntax error itself
    return deepest, too_long


def _too_long(number: str) -> bool:
    """Whether a NUMBER token is an integer with more digits than any int64 has. Such a
    literal is refused from its text: Python would not even convert one of over 4,300
    decimal digits (`ast.parse` suggests `sys.set_int_max_str_digits`), and whatever its
    value, it is outside PyTorch's integer range. A shorter one past int64 is refused by
    the op that takes it."""
    digits = number.replace("_", "").lower()
    limit = _INT64_DIGITS.get(digits[:2])
    if limit is not None:
        digits = digits[2:]
    elif any(c in digits for c in ".ej"):
        return False  # a float or an imaginary number
    else:
        limit = _INT64_DECIMAL_DIGITS
    return len(digits.lstrip("0")) > limit


def _ast_depth(root: ast.AST) -> int:
    """Expressions within expressions (`-(a + f(b))` is 4 deep); keyword values count as
    their call's operands."""
    deepest = 0
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > deepest:
            deepest = depth
        children = _CHILDREN.get(type(node))
        for child in children(node) if children else _expressions(node):
            stack.append((child, depth + 1))
    return deepest


def _expressions(node: ast.AST) -> list[ast.AST]:
    """The expressions directly inside `node` (a keyword stands for its value)."""
    out: list[ast.AST] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.keyword):
            child = child.value
        if isinstance(child, ast.expr):
            out.append(child)
    return out


# The same children as `_expressions`, for the pieces expr allows, without ast's generic walk.
_CHILDREN: dict[type, Callable[[Any], list[ast.AST]]] = {
    ast.Name: lambda n: [],
    ast.Constant: lambda n: [],
    ast.BinOp: lambda n: [n.left, n.right],
    ast.UnaryOp: lambda n: [n.operand],
    ast.Compare: lambda n: [n.left, *n.comparators],
    ast.Call: lambda n: [n.func, *n.args, *(k.value for k in n.keywords)],
    ast.List: lambda n: list(n.elts),
    ast.Tuple: lambda n: list(n.elts),
}


class _Compiler:
    def __init__(self, node_id: str, text: str, new_id: Callable[[], str]) -> None:
        self.node_id = node_id
        self.text = text
        self.ascii = text.isascii()
        self.new_id = new_id
        self.nodes: list[NodeSpec] = []
        self.spans: dict[str, Span] = {}
        self.piece: ast.expr | None = None  # the piece being built
        self.line_shift = self.col_shift = 0  # where the stripped text starts in the given

    def fail(
        self,
        message: str,
        piece: ast.AST | None = None,
        hint: str = "",
        kind: type[GraphError] = ExprError,
    ) -> GraphError:
        if piece is not None:
            segment = ast.get_source_segment(self.text, piece) or ""
            message = f"{message}: {quoted(segment, 40)}" if segment else message
        return kind(message + hint, node=self.node_id, loc=("expr",))

    def refuse(self, piece: ast.AST) -> GraphError:
        what = _DESCRIBE.get(type(piece), f"a {type(piece).__name__} expression")
        return self.fail(f"{what} is not allowed in expr", piece)

    def emit(self, op: str, args: list[Value], attrs: dict[str, Any] | None = None) -> str:
        node = NodeSpec(id=self.new_id(), op=op, args=args, attrs=attrs or {})
        self.nodes.append(node)
        piece = self.piece
        if piece is not None:
            self.spans[node.id] = (
                piece.lineno + self.line_shift,
                piece.col_offset + (self.col_shift if piece.lineno == 1 else 0),
                piece.end_lineno + self.line_shift,  # type: ignore[operator]
                piece.end_col_offset  # type: ignore[operator]
                + (self.col_shift if piece.end_lineno == 1 else 0),
            )
        return node.id

    def name(self, piece: ast.Name) -> str:
        # Python NFKC-normalises identifiers ('ｘ' reads as 'x'): refuse rather than
        # silently reference another value. (ASCII is its own normal form.)
        if self.ascii:
            return piece.id
        raw = ast.get_source_segment(self.text, piece)
        if raw != piece.id:
            raise self.fail(f"identifier {quoted(raw or '')} is not in normal form", piece)
        return piece.id

    def number(self, piece: ast.AST) -> bool | int | float | None:
        """A number literal (with unary signs folded in), or None if `piece` is not one."""
        sign = 1
        while isinstance(piece, ast.UnaryOp) and isinstance(piece.op, (ast.USub, ast.UAdd)):
            sign = -sign if isinstance(piece.op, ast.USub) else sign
            piece = piece.operand
        if isinstance(piece, ast.Constant) and isinstance(piece.value, (bool, int, float)):
            value = piece.value
            if sign < 0:
                if isinstance(value, bool):
                    return None
                return -value
            return value
        return None

    def attribute(self, piece: ast.AST) -> Any:
        """A keyword value: a number, bool, string, None, or a list/tuple of ints."""
        number = self.number(piece)
        if number is not None:
            return number
        if isinstance(piece, ast.Constant) and (piece.value is None or _is_string(piece)):
            return piece.value
        if isinstance(piece, (ast.List, ast.Tuple)):
            items = [self.number(e) for e in piece.elts]
            if all(isinstance(v, int) and not isinstance(v, bool) for v in items):
                return items
            raise self.fail("attribute lists may hold integers only", piece)
        hint = ""
        if isinstance(piece, ast.Name) and piece.id in _JSON_CONSTANTS:
            hint = f"; did you mean {_JSON_CONSTANTS[piece.id]}?"  # `keepdim=true`, as in JSON
        raise self.fail(
            "attribute values must be literals (numbers, strings, lists of ints)", piece, hint
        )

    def compile(self, root: ast.AST) -> Value:
        """Post-order over the AST with an explicit stack (no recursion on depth)."""
        done: dict[int, Value] = {}
        stack: list[tuple[ast.AST, bool]] = [(root, False)]
        while stack:
            piece, expanded = stack.pop()
            if expanded:
                self.piece = piece  # type: ignore[assignment]
                done[id(piece)] = self.build(piece, done)
                continue
            number = self.number(piece)
            if number is not None:
                done[id(piece)] = number
                continue
            stack.append((piece, True))
            stack.extend((child, False) for child in reversed(self.operands(piece)))
        return done[id(root)]

    def operands(self, piece: ast.AST) -> list[ast.AST]:
        """The tensor-valued children of a piece (checked against the whitelist)."""
        if isinstance(piece, ast.Name):
            return []
        if isinstance(piece, ast.BinOp):
            if type(piece.op) not in _BINARY:
                raise self.fail("operator not allowed (use + - * / ** @)", piece)
            return [piece.left, piece.right]
        if isinstance(piece, ast.UnaryOp):
            if not isinstance(piece.op, (ast.USub, ast.UAdd)):
                raise self.fail("only unary + and - are allowed", piece)
            return [piece.operand]
        if isinstance(piece, ast.Compare):
            if len(piece.ops) != 1 or type(piece.ops[0]) not in _COMPARE:
                raise self.fail("only single comparisons (< <= > >= == !=) are allowed", piece)
            return [piece.left, piece.comparators[0]]
        if isinstance(piece, ast.Call):
            self.callee(piece)
            if any(isinstance(a, ast.Starred) for a in piece.args):
                raise self.refuse(next(a for a in piece.args if isinstance(a, ast.Starred)))
            return [a for a in piece.args if not _is_string(a)]
        if isinstance(piece, ast.Constant):
            if isinstance(piece.value, str):
                raise self.fail("strings are only allowed as attribute values", piece)
            raise self.fail("unsupported literal", piece)
        if isinstance(piece, (ast.List, ast.Tuple)):
            raise self.fail("lists are only allowed as attribute values", piece)
        raise self.refuse(piece)

    def callee(self, call: ast.Call) -> str:
        if not isinstance(call.func, ast.Name):
            raise self.fail("only catalog ops can be called", call.func)
        name = self.name(call.func)
        if name not in OPS and name not in TRANSFORMS:
            hint = did_you_mean(name, [*OPS, *TRANSFORMS])
            # The same problem as an unknown `op` field: `unknown-op`, not `expr`.
            raise self.fail(
                f"unknown op {quoted(name)}{hint} (see GET /ops)", call.func, kind=UnknownOpError
            )
        if name in ("scan", "vmap"):
            raise self.fail(f"{name} takes a body and results: write it as an op node", call.func)
        return name

    def build(self, piece: ast.AST, done: dict[int, Value]) -> Value:
        if isinstance(piece, ast.Name):
            return self.name(piece)
        if isinstance(piece, ast.BinOp):
            return self.emit(_BINARY[type(piece.op)], [done[id(piece.left)], done[id(piece.right)]])
        if isinstance(piece, ast.UnaryOp):
            operand = done[id(piece.operand)]
            return operand if isinstance(piece.op, ast.UAdd) else self.emit("neg", [operand])
        if isinstance(piece, ast.Compare):
            return self.emit(
                _COMPARE[type(piece.ops[0])], [done[id(piece.left)], done[id(piece.comparators[0])]]
            )
        assert isinstance(piece, ast.Call)
        return self.call(piece, done)

    def call(self, piece: ast.Call, done: dict[int, Value]) -> Value:
        name = self.callee(piece)
        op = OPS.get(name)
        attrs: dict[str, Any] = {}
        strings = [a for a in piece.args if _is_string(a)]
        if strings:
            # A leading string is the op's string attribute, as in einsum("ij,jk->ik", a, b).
            first = (op.call_order or ("",))[0] if op is not None else ""
            if (
                op is None
                or len(strings) > 1
                or piece.args[0] is not strings[0]
                or first not in op.attrs
            ):
                raise self.fail("strings are only allowed as attribute values", strings[0])
            attrs[first] = strings[0].value  # type: ignore[attr-defined]
        for kw in piece.keywords:
            if kw.arg is None:
                raise self.fail("'**' arguments are not allowed", kw.value)
            if kw.arg in attrs:
                raise self.fail(f"attribute {quoted(kw.arg)} given twice", kw.value)
            attrs[kw.arg] = self.attribute(kw.value)
        args = [done[id(a)] for a in piece.args if not _is_string(a)]
        return self.emit(name, args, attrs)


def _is_string(piece: ast.AST) -> bool:
    return isinstance(piece, ast.Constant) and isinstance(piece.value, str)


def expand_expr(
    node_id: str, text: str, *, new_id: Callable[[], str], max_chars: int, max_depth: int
) -> Expansion:
    """Compile one `expr` node into op-form nodes; raises ExprError naming the node."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError("expr must be a non-empty string", node=node_id, loc=("expr",))
    if len(text) > max_chars:
        raise ExprError(
            f"expr is {len(text)} characters long; the limit is {max_chars}",
            node=node_id,
            loc=("expr",),
        )
    too_deep = ExprError(
        f"expr is nested more than {max_depth} levels deep", node=node_id, loc=("expr",)
    )
    depth, too_long = _scan_tokens(text)
    if depth > max_depth:
        raise too_deep
    if too_long is not None:
        raise ExprError(
            f"integer literal {quoted(too_long, 24)} is too long for int64 "
            "(PyTorch's integer range)",
            node=node_id,
            loc=("expr",),
        )
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError as exc:
        where = f" (column {exc.offset})" if exc.offset else ""
        raise ExprError(
            f"invalid expression: {exc.msg}{where}", node=node_id, loc=("expr",)
        ) from None
    except (RecursionError, MemoryError, ValueError):
        raise too_deep from None
    if _ast_depth(tree.body) > max_depth:
        raise too_deep
    compiler = _Compiler(node_id, text.strip(), new_id)
    lead = text[: len(text) - len(text.lstrip())]
    compiler.line_shift = lead.count("\n")
    compiler.col_shift = len(lead) - (lead.rfind("\n") + 1)
    value = compiler.compile(tree.body)
    if isinstance(value, str) and (not compiler.nodes or value != compiler.nodes[-1].id):
        return Expansion([], alias=value)  # the whole expression is a name: an alias
    if not isinstance(value, str):
        # A literal-only expression is a constant.
        compiler.nodes.append(NodeSpec(id=node_id, op="full", attrs={"shape": [], "value": value}))
        return Expansion(compiler.nodes)
    last = compiler.nodes[-1]
    compiler.nodes[-1] = NodeSpec(id=node_id, op=last.op, args=last.args, attrs=last.attrs)
    spans = compiler.spans
    if last.id in spans:
        spans[node_id] = spans.pop(last.id)
    return Expansion(compiler.nodes, spans=spans)
