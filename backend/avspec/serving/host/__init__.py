"""What starts, sandboxes and guards `tritonserver` on the host: the launcher, the server process
and its stage supervisor, the pair check, the host's cost tables. Imports the front (which it
starts), `avspec.serving.repository` and `avspec.serving.exposure`; never the stage side."""
