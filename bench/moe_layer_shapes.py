"""The shapes of examples/moe_layer for the bench's models of its layer:
--model and --tokens as the example takes them, or --shape T,H,I,E,K.
The model table mirrors the example's (examples/moe_layer.c, `models`)."""

# name: hidden, intermediate, experts, top k
MODELS = {
    "small": (1024, 3584, 8, 2),     # Mixtral-8x7B's experts with H and I divided by 4
    "mixtral": (4096, 14336, 8, 2),  # Mixtral-8x7B
    "qwen3": (2048, 768, 128, 8),    # Qwen3-30B-A3B
}


def add_arguments(ap):
    """The shape options, as the example names them."""
    ap.add_argument("--model", choices=sorted(MODELS),
                    help="the example's --model (default small)")
    ap.add_argument("--tokens", type=int, help="the example's --tokens (default 128)")
    ap.add_argument("--shape", metavar="T,H,I,E,K",
                    help="tokens, hidden, intermediate, experts, top k (instead of --model and --tokens)")


def parse(ap, a):
    """(T, H, I, E, K) from the options; ap.error on a contradiction."""
    if a.shape is not None:
        if a.model is not None or a.tokens is not None:
            ap.error("--shape gives every size: it takes no --model or --tokens")
        try:
            dims = tuple(int(v) for v in a.shape.split(","))
        except ValueError:
            dims = ()
        if len(dims) != 5 or min(dims) < 1:
            ap.error("--shape takes five positive integers T,H,I,E,K, not %r" % a.shape)
        if dims[4] > dims[3]:
            ap.error("--shape: top k (%d) exceeds the experts (%d)" % (dims[4], dims[3]))
        return dims
    tokens = 128 if a.tokens is None else a.tokens
    if tokens < 1:
        ap.error("--tokens must be positive")
    return (tokens,) + MODELS[a.model or "small"]
