"""Tool calling on the server: the request's `tools` and `tool_choice` checked and resolved into one `ToolMode`.

`auto`: the model may call a tool; its output is parsed (serve/chat/turn.py). `none`: nothing is parsed.
`required` and a named function are *guaranteed*: the output is generated under a JSON schema by the
structured-outputs engine (serve/response_format.py's engine, llguidance) and wrapped into tool calls here, instead of
asking the model for its own tool-call markup. A named function's output is its arguments object (the
function's `parameters` schema); `required`'s is a JSON array of `{"name": ..., "arguments": {...}}` objects,
one `anyOf` branch per tool, one item at most without `parallel_tool_calls`. Either parses by construction.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import NotRequired, TypedDict

from ...sampling.structured.guided import GuidedDecoding
from ..protocol import ApiError, ToolDefinition

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 200_000  # the tool definitions as JSON text: they are rendered into every prompt
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's function names (and dotted namespaces)
EMPTY_PARAMETERS: dict[str, object] = {"type": "object", "properties": {}}


class FunctionDefinition(TypedDict):
    """A tool's function as the chat template gets it (OpenAI's `tools[i].function`)."""

    name: str
    parameters: dict[str, object]  # a JSON schema of the arguments object
    description: NotRequired[str]


class ToolDefinitionEntry(TypedDict):
    """One checked tool definition: `{"type": "function", "function": ...}`."""

    type: str
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: `arguments` is JSON text (OpenAI's wire form)."""

    name: str
    arguments: str
    id: str = ""

    def wire(self, index: int | None = None) -> dict[str, object]:
        call: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call = {"index": index, **call}
        return call


def new_call(name: str, arguments: object) -> ToolCall:
    """A tool call with a fresh id; `arguments` as parsed JSON (or already JSON text)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, "call_" + uuid.uuid4().hex[:24])


@dataclass(frozen=True)
class ToolMode:
    """What a chat request allows: `mode` is none, auto, required or named (`name`: the function)."""

    mode: str
    tools: tuple[ToolDefinitionEntry, ...] = ()  # the definitions as the chat template gets them
    name: str | None = None
    parallel: bool = True

    @property
    def parses(self) -> bool:
        """The model's own tool-call markup is parsed from its output (`auto`)."""
        return self.mode == "auto" and bool(self.tools)

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")

    def parameters(self, name: str) -> dict[str, object]:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return dict(tool["function"]["parameters"] or EMPTY_PARAMETERS)
        raise KeyError(name)

    def names(self) -> list[str]:
        return [tool["function"]["name"] for tool in self.tools]

    def guided(self) -> GuidedDecoding | None:
        """The constraint that guarantees a forced call (None unless `required` or named)."""
        if self.mode == "named" and self.name is not None:
            return GuidedDecoding(json=self.parameters(self.name))
        if self.mode != "required":
            return None
        branches = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.names()
        ]
        schema: dict[str, object] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not self.parallel:
            schema["maxItems"] = 1
        return GuidedDecoding(json=schema)

    def forced_calls(self, text: str) -> list[ToolCall] | None:
        """The calls a forced output holds (None: it was cut short, e.g. by `max_tokens`)."""
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):  # cut short, or nested past Python's limit
            return None
        if self.mode == "named" and self.name is not None and isinstance(value, dict):
            return [new_call(self.name, value)]
        if self.mode == "required" and isinstance(value, list):
            calls = [
                new_call(item["name"], item["arguments"])
                for item in value
                if isinstance(item, dict) and item.get("name") in self.names() and "arguments" in item
            ]
            return calls or None
        return None


def tool_mode(
    tools: list[ToolDefinition] | None, tool_choice: str | dict[str, object] | None, parallel: bool | None
) -> ToolMode:
    """Check the request's tool fields (400s name the field) and resolve what the model may do."""
    definitions = _definitions(tools or [])
    choice = tool_choice if tool_choice is not None else ("auto" if definitions else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ApiError(
                400,
                f"tool_choice: {choice!r} is not one of 'none', 'auto', 'required' or a named function",
                param="tool_choice",
            )
        if choice == "required" and not definitions:
            raise ApiError(400, "tool_choice: 'required' needs tools", param="tool_choice")
        return ToolMode(choice, definitions, parallel=parallel is not False)
    name = _named_choice(choice)
    if name not in [tool["function"]["name"] for tool in definitions]:
        raise ApiError(400, f"tool_choice: no tool named {name!r} in tools", param="tool_choice")
    return ToolMode("named", definitions, name=name, parallel=parallel is not False)


def _named_choice(choice: dict[str, object]) -> str:
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(
            400,
            'tool_choice: a named choice is {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    return name


def _definitions(tools: list[ToolDefinition]) -> tuple[ToolDefinitionEntry, ...]:
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    definitions: list[ToolDefinitionEntry] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        function = tool.function
        where = f"tools.{i}.function"
        if not NAME_PATTERN.match(function.name):
            raise ApiError(
                400,
                f"{where}.name: {function.name!r} must be 1-64 letters, digits, '_', '-' or '.'",
                param=f"{where}.name",
            )
        if function.name in seen:
            raise ApiError(400, f"{where}.name: {function.name!r} is defined twice", param=f"{where}.name")
        seen.add(function.name)
        parameters = function.parameters if function.parameters is not None else EMPTY_PARAMETERS
        if parameters.get("type", "object") != "object":
            raise ApiError(
                400,
                f"{where}.parameters: must be a JSON schema of type 'object' (the arguments), "
                f"got type {parameters.get('type')!r}",
                param=f"{where}.parameters",
            )
        entry: FunctionDefinition = {"name": function.name, "parameters": parameters}
        if function.description is not None:
            entry["description"] = function.description
        definitions.append({"type": "function", "function": entry})
    if len(json.dumps(definitions)) > MAX_TOOLS_CHARS:
        raise ApiError(
            400, f"tools: the definitions exceed {MAX_TOOLS_CHARS} characters of JSON", param="tools"
        )
    return tuple(definitions)
