"""A token's text as a store holds it (the `token` column of the tokens table): what the writer decodes and what a
reader decodes again from the run's tokenizer (hookrun.read.results.lens), with no torch.

    token_texts(tok, [450, 6635])   # Llama: [' The', ' cat']
"""
from __future__ import annotations

import weakref
from typing import List, Optional


def token_texts(tokenizer, ids) -> List[str]:
    """Each token id's text as the tokenizer decodes it inside a text, so that a sequence's texts joined read as the
    text did: a SentencePiece (Metaspace) "▁The" is " The" and a WordPiece "##ing" is "ing" (decode([id]) alone
    drops the leading space of SentencePiece and keeps WordPiece's ##); byte-level BPE as decode([id]). The text is
    decode([anchor, id]) less decode([anchor]) for a plain anchor token; special tokens as decode([id]).

        token_texts(tok, [450, 6635])   # Llama: [' The', ' cat']"""
    ids = [int(i) for i in ids]
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    anchor = _anchor(tokenizer, special)
    head = tokenizer.decode([anchor]) if anchor is not None else None
    out = []
    for i in ids:
        if anchor is None or i in special:
            out.append(tokenizer.decode([i]))
            continue
        both = tokenizer.decode([anchor, i])
        out.append(both[len(head):] if both.startswith(head) else tokenizer.decode([i]))
    return out


def _anchor(tokenizer, special) -> Optional[int]:
    """A plain token to decode others after: the first of a few ASCII letters the tokenizer has as one token
    (looked up once a tokenizer object and vocabulary size: get_vocab builds the whole vocabulary's dict)."""
    key = (len(tokenizer) if hasattr(tokenizer, "__len__") else None, frozenset(special))
    try:
        known = _ANCHORS.setdefault(tokenizer, {})
    except TypeError:  # no weak reference to it
        known = {}
    if key not in known:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        known[key] = next((int(vocab[w]) for w in ("a", "x", "▁a", "Ġa", "▁x")
                           if vocab.get(w) is not None and vocab[w] not in special), None)
    return known[key]


_ANCHORS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # tokenizer -> {(size, special): anchor}
