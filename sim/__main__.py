"""Lets `python -m sim` start the simulator, so tests need no installed entry point."""

from sim.cli import sim_server

if __name__ == "__main__":
    sim_server()
