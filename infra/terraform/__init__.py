"""The Terraform renderer: the program run under mocks and written as Terraform JSON (document.py), through cdktf in
its own venv (synth.py runs cdktf_app.py there; refs.py is what both sides read). Nothing here may import Pulumi at
package level: cdktf_app.py imports this package in a venv without it."""
