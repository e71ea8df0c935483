from node.cli import app

app(prog_name="needle-net")
