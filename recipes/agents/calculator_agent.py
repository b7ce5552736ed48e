"""A plain OpenAI-SDK agent: it asks the model, answers the model's calculator calls with a
local function, and stops at the first reply without a call (that reply is its answer).

Trained unchanged by `rl-train recipes/quickstart_openai_agent.yaml`
(env: {name: openai_agent, args: {program: recipes/agents/calculator_agent.py:solve}}): rlstack
gives `solve` an openai.AsyncOpenAI whose base_url is a session on its rollout engine. Pointed
at any other OpenAI-compatible server, it runs the same way. Imports: openai's client (given)
and the standard library only.
"""
import ast
import json
import operator

CALCULATOR = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an arithmetic expression and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string",
        "description": "The expression, e.g. \"37 * 482\" or \"(2.5 + 3) / 4\"."}},
        "required": ["expression"]}}}

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """+ - * / on numbers, from the syntax tree (no eval); errors come back as text."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"'{ast.unparse(node)}' is not arithmetic")
    try:
        return str(value(ast.parse(str(expression).strip(), mode="eval").body))
    except (ValueError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


async def solve(client, row, max_calls: int = 3):
    messages = list(row["prompt"])  # the row's question, as chat messages
    for _ in range(max_calls):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=40)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return None  # the run's reward functions score this final answer
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except (TypeError, ValueError) as e:  # arguments it does not take: tell the model
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
