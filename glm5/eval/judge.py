"""A judge model served over the OpenAI API grades free-form answers to user queries.

The judge gets the query, the reference answer and/or rubric keywords, and the answer, and must end
its reply with `Score: N` (N from 1 to 10); the grade is N / 10. A reply without a score counts as
None (left out of the mean) rather than guessed.
"""

from __future__ import annotations

import re

from .openai_model import OpenAIClient

PROMPT = """You are grading an assistant's answer to a user's query.
Query: {query}
{reference}Answer: {answer}

Judge correctness, helpfulness and completeness. Reply with one short sentence of reasons, then a last line
"Score: N" where N is an integer from 1 (useless) to 10 (perfect)."""
SCORE = re.compile(r"score\s*[:：]\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


class Judge:
    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 client: OpenAIClient | None = None):
        self.client = client or OpenAIClient(base_url, api_key)
        self.model = model or self.client.first_model()
        self.name = f"{base_url}#{self.model}"

    def grade(self, query: str, answer: str, reference: str | None = None,
              keywords: list[str] | None = None) -> float | None:
        ref = f"Reference answer: {reference}\n" if reference else ""
        if keywords:
            ref += f"A good answer mentions: {', '.join(keywords)}\n"
        payload = {"model": self.model, "temperature": 0, "max_tokens": 128, "messages": [
            {"role": "user", "content": PROMPT.format(query=query, reference=ref, answer=answer)}]}
        reply = self.client.request("/chat/completions", payload)["choices"][0]["message"]["content"] or ""
        found = SCORE.findall(reply)
        if not found:
            return None
        return min(10.0, max(1.0, float(found[-1]))) / 10
