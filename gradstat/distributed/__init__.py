"""One process or many: what torchrun's environment says (launcher), and the processes of one
command joining, agreeing, splitting rank files or jobs, gathering results and naming a lost
process (runner)."""
