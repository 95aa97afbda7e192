"""How far predictions hold: the checks that price plans and compare them with measurements (published runs,
gloo ranks, one GPU). A top layer like the CLI: it may use every other part; nothing imports it."""
