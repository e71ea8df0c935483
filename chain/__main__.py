from chain.cli import app

app(prog_name="chain")
