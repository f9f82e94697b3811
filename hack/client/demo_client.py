#!/opt/client/bin/python
"""Stream completions from a pod with the official openai SDK and print them with their usage.

    tally-demo-client BASE_URL                   one chat completion, its text and usage (the demo)
    tally-demo-client BASE_URL --requests N      N streamed completions, one JSON line of usage each (the tests)
"""

import argparse
import json
import time

import openai

MODEL = "smollm2-135m-instruct"


def connect(client: openai.OpenAI, deadline: float, **request: object) -> openai.Stream:  # type: ignore[type-arg]
    while True:
        try:
            return client.chat.completions.create(model=MODEL, stream=True, stream_options={"include_usage": True},
                                                  **request)  # type: ignore[call-overload,no-any-return]
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def demo(client: openai.OpenAI, base_url: str) -> None:
    stream = connect(client, time.monotonic() + 60, messages=[{"role": "user", "content": "Name three colors."}],
                     max_tokens=40, temperature=0)
    print(f"[demo] streaming from {base_url}:\n", flush=True)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print(f"\n\n[demo] usage: {usage.model_dump_json() if usage else None}\n", flush=True)


def measured(client: openai.OpenAI, requests: int, max_tokens: int) -> None:
    for i in range(requests):
        stream = connect(client, time.monotonic() + 60, messages=[{"role": "user", "content": f"Count to {i + 3}."}],
                         max_tokens=max_tokens)
        text, usage = "", None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        assert usage is not None, "no usage chunk"
        print(json.dumps({"prompt": usage.prompt_tokens, "completion": usage.completion_tokens, "text": text}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base_url")
    parser.add_argument("--requests", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url, api_key="unused", max_retries=0)
    if args.requests:
        measured(client, args.requests, args.max_tokens)
    else:
        demo(client, args.base_url)


if __name__ == "__main__":
    main()
