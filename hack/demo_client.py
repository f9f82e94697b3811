#!/usr/bin/env python3
"""Stream one completion from a pod with the official openai SDK and print it with its usage."""

import sys
import time

import openai


def main(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    deadline = time.monotonic() + 60
    while True:
        try:
            stream = client.chat.completions.create(
                model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Name three colors."}],
                max_tokens=40, temperature=0, stream=True, stream_options={"include_usage": True})
            break
        except openai.APIConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    print(f"[demo] streaming from {base_url}:\n", flush=True)
    usage = None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
        usage = chunk.usage or usage
    print(f"\n\n[demo] usage: {usage.model_dump_json() if usage else None}\n", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
