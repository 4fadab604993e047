"""The tool-call parser: one test per case, and the error an environment answers with instead of crashing."""

from orbitctl.rl.envs.tools import Tool, ToolCall, ToolCallError, format_call, parse_tool_call

TOOLS = (Tool("go", "Walk to a room.", {"room": "string"}),
         Tool("put", "Put something somewhere.", {"object": "string", "receptacle": "string"}),
         Tool("look", "Look around."))


def _error(action: str) -> ToolCallError:
    parsed = parse_tool_call(action, TOOLS)
    assert isinstance(parsed, ToolCallError), parsed
    assert parsed.message.startswith("Error: ")
    return parsed


def test_a_valid_call_with_or_without_the_tags():
    tagged = '<tool_call>\n{"name": "put", "arguments": {"object": "mug", "receptacle": "desk"}}\n</tool_call>'
    assert parse_tool_call(tagged, TOOLS) == ToolCall("put", {"object": "mug", "receptacle": "desk"})
    assert parse_tool_call('  {"name": "go", "arguments": {"room": "kitchen"}} ', TOOLS) == \
        ToolCall("go", {"room": "kitchen"})
    assert parse_tool_call('{"name": "look"}', TOOLS) == ToolCall("look", {})  # a tool without arguments
    assert parse_tool_call(format_call("go", {"room": "attic"}), TOOLS) == ToolCall("go", {"room": "attic"})
    # arguments written as a JSON string, as some templates do
    as_string = '{"name": "go", "arguments": "{\\"room\\": \\"bath\\"}"}'
    assert parse_tool_call(as_string, TOOLS) == ToolCall("go", {"room": "bath"})


def test_bad_json_is_an_error():
    assert _error('<tool_call>{"name": "go", "arguments": {"room": kitchen}}</tool_call>').kind == "bad_json"
    assert _error('{"name": "go", "arguments": {"room": "kitchen"}').kind == "bad_json"
    assert _error("go to the kitchen").kind == "bad_json"
    assert _error('<tool_call>\n{"name": "go", "arguments": {"room": "kitchen"}}').kind == "bad_json"  # not closed
    assert _error('["go", "kitchen"]').kind == "bad_json"


def test_an_unknown_tool_is_an_error_that_lists_the_tools():
    error = _error('<tool_call>{"name": "fly", "arguments": {"room": "kitchen"}}</tool_call>')
    assert error.kind == "unknown_tool" and '"fly"' in error.message and "go, put, look" in error.message
    assert _error('{"arguments": {"room": "kitchen"}}').kind == "unknown_tool"  # no name at all


def test_a_missing_argument_is_an_error_that_names_it():
    error = _error('<tool_call>{"name": "put", "arguments": {"object": "mug"}}</tool_call>')
    assert error.kind == "missing_argument" and "'receptacle'" in error.message
    assert _error('{"name": "go"}').kind == "missing_argument"


def test_a_mistyped_argument_is_an_error_and_an_undeclared_one_is_dropped():
    assert parse_tool_call('{"name": "go", "arguments": {"room": "hall", "speed": "fast"}}', TOOLS) == \
        ToolCall("go", {"room": "hall"})
    assert _error('{"name": "go", "arguments": {"room": 3}}').kind == "bad_argument"
    assert _error('{"name": "go", "arguments": ["hall"]}').kind == "bad_argument"


def test_extra_text_around_the_call_is_an_error():
    call = '<tool_call>{"name": "go", "arguments": {"room": "kitchen"}}</tool_call>'
    assert _error("Sure, I will go. " + call).kind == "extra_text"
    assert _error(call + " Then I will look around.").kind == "extra_text"
    assert _error('{"name": "go", "arguments": {"room": "kitchen"}} and then more').kind == "extra_text"
    assert _error('<tool_call>{"name": "go", "arguments": {"room": "kitchen"}} done</tool_call>').kind == "extra_text"


def test_the_spec_is_openai_function_format():
    spec = TOOLS[1].spec()
    assert spec["type"] == "function" and spec["function"]["name"] == "put"
    assert spec["function"]["parameters"]["required"] == ["object", "receptacle"]
    assert spec["function"]["parameters"]["properties"]["object"]["type"] == "string"
