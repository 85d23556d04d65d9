"""vLLM's tokenizer endpoints: POST /tokenize (a prompt's or a conversation's token ids, as the completion endpoints
would encode them) and POST /detokenize (ids back to text)."""

from __future__ import annotations

import asyncio

from vibeqwen.server.chat import offered_tools, render_prompt
from vibeqwen.server.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from vibeqwen.server.serving import APIError, Serving


async def tokenize(serving: Serving, body: TokenizeRequest) -> TokenizeResponse:
    """The token ids of `body.prompt`, or of the prompt the chat template renders for `body.messages` (the ids
    /v1/chat/completions would prefill), with the server's max_model_len; not limited to it (clients count to
    check). Raises APIError: 404 for another model, 400 for what the template or the tokenizer refuses."""
    serving.check_model(body.model)
    if body.messages is not None:
        ids = await render_prompt(serving, body, offered_tools(body), check_length=False)
    else:
        ids = await asyncio.to_thread(serving.encode_prompt, body.prompt, "prompt", False)
    tokenizer = serving.engine.tokenizer
    strs = None
    if body.return_token_strs:
        # the byte-level BPE strings (vLLM's convert_ids_to_tokens); a tokenizer without them: each id's text.
        # Off the event loop: megabytes of prompt are millions of tokens
        spell = getattr(tokenizer, "id_to_token", None) or (lambda i: tokenizer.decode([i]))
        strs = await asyncio.to_thread(lambda: [spell(i) or "" for i in ids])
    return TokenizeResponse(count=len(ids), max_model_len=serving.engine.max_model_len, tokens=ids, token_strs=strs)


async def detokenize(serving: Serving, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of `body.tokens` (special tokens included). Raises APIError: 404 for another model, 400 for an id
    outside the vocabulary."""
    serving.check_model(body.model)
    # the tokenizer's ids (the embedding has padding rows past them, which have no text)
    vocab = getattr(serving.engine.tokenizer, "vocab_size", None) or serving.vocab_size
    bad = next((i for i, t in enumerate(body.tokens) if vocab is not None and t >= vocab), None)
    if bad is not None:
        raise APIError(f"token id {body.tokens[bad]} is outside the tokenizer's vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]")
    text = await asyncio.to_thread(serving.engine.tokenizer.decode, body.tokens)
    return DetokenizeResponse(prompt=text)
