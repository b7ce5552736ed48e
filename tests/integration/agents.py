"""An OpenAI-SDK agent program for the openai_agent tests: three calls (the row's question,
then "go on" after each reply), each asking for its tokens' logprobs; every session appends
what its calls returned to the file the row names (row["log"]). A row's "how" makes it raise
or hang before its second call, or return garbage."""
import asyncio
import json

GO_ON = {"role": "user", "content": "go on"}
TURN = 4  # the most tokens of a call


async def solve(client, row):
    messages, calls = list(row["prompt"]), []
    for k in range(3):
        if k == 1 and row["how"] == "raise":
            raise RuntimeError("the agent broke")
        if k == 1 and row["how"] == "hang":
            await asyncio.sleep(30)
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     max_tokens=TURN, logprobs=True)
        choice = reply.choices[0]
        calls.append({"tokens": [t.token for t in choice.logprobs.content],
                      "logprobs": [t.logprob for t in choice.logprobs.content],
                      "fingerprint": reply.system_fingerprint})
        messages += [choice.message, GO_ON]
    with open(row["log"], "a") as f:
        f.write(json.dumps({"q": row["q"], "calls": calls}) + "\n")
    return "garbage" if row["how"] == "garbage" else None
