"""The device substrate the runners stand on: Triton set-up, the forward context, the
model executor and the runners' shared set-up, the graph-capture helper and step timing.
Same layer as shared.model, shared.attention and shared.sampling."""
