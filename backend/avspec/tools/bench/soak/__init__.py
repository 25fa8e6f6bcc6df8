"""The soak test's library: hold concurrent client loops against `speculative`, watch memory.

client/soak.py is the command line over these modules (start a server or attach to one, run,
write the outputs, exit status); its docstring describes the run as a whole.

One module per concept:

- `tensors`: the `speculative` model's input tensors as a Triton client sends them;
- `mix`: the request mix (protocol, prompt, max_tokens, temperature, draft length, cancel);
- `load`: sending one request over gRPC streaming, HTTP /generate or /generate_stream
  (cancelling where the mix says so), the outcome tally and the client loops;
- `memory`: finding tritonserver and its Python-backend stubs (avspec.serving.host.supervisor),
  sampling their RSS and the /dev/shm files, and /dev/shm after the server stopped;
- `growth`: RSS growth after the warm-up and the plateau test over its first and last third;
- `drain`: live sequences after the load (a cancelled request that keeps its slot is a leak);
- `report`: the soak.json document, the verdict, summary.txt and memory.png.
"""
