"""Recipe parsing: malformed recipes give one clear error naming the place."""

from __future__ import annotations

import pytest

from weenv.errors import InvalidInputError
from weenv.packaging.recipe import load_recipe, parse_recipe


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[template\nname=1", "not valid TOML"),
        ('[template]\nname = "t"\n', "component: Field required"),
        (
            '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "frobnicate"\n',
            "component 1 ('a'), step 1 (frobnicate): Input tag 'frobnicate'",
        ),
        (
            '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "run"\n'
            'commands = "true"\ncolour = "red"\n',
            "component 1 ('a'), step 1 (run), colour: Extra inputs",
        ),
        (
            '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "copy"\n'
            'src = "x"\ndest = "relative"\n',
            "not an absolute path",
        ),
        ('[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "pip"\n', "needs requirements"),
        (
            '[template]\nname = "T!"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "run"\ncommands = "x"\n',
            "template, name",
        ),
        (
            '[template]\nname = "t"\n[[component]]\nname = "a"\n[[component.step]]\nkind = "run"\ncommands = "x"\n'
            '[[component]]\nname = "a"\n[[component.step]]\nkind = "run"\ncommands = "y"\n',
            "repeated: a",
        ),
        ('[template]\nname = "t"\n[[component]]\nname = "a"\nstep = []\n', "component 1 ('a'), step"),
    ],
)
def test_malformed_recipes_give_clear_errors(text, expected):
    with pytest.raises(InvalidInputError) as info:
        parse_recipe(text, origin="r.toml")
    assert expected in str(info.value)
    assert str(info.value).startswith("r.toml: ")


def test_recipe_runtime_env_is_merged_over_the_defaults(tmp_path):
    r = parse_recipe(
        '[template]\nname = "t"\n[template.runtime]\nworking_dir = "/w"\nenv = { A = "1" }\n'
        '[[component]]\nname = "a"\n[[component.step]]\nkind = "from_dir"\npath = "d"\n',
        base_dir=tmp_path,
    )
    assert r.template.runtime.env["A"] == "1" and r.template.runtime.env["PATH"].startswith("/usr/local")
    assert r.path("d") == tmp_path / "d"
    assert not r.component[0].needs_environment


def test_unreadable_recipe(tmp_path):
    with pytest.raises(InvalidInputError, match="cannot read recipe"):
        load_recipe(tmp_path / "missing.toml")


def test_a_run_step_without_build_environments_is_refused_before_any_build(tmp_path):
    """packaging does not import the node: build_recipe is handed the runtime of
    ``run``/``pip`` steps (``weenv.build.buildenv.NodeBuildEnvironments``); without
    one it refuses such a recipe in one line, before anything is built or written."""
    from weenv.config import Paths
    from weenv.packaging.builder import build_recipe
    from weenv.store.file import FileStore

    (tmp_path / "tree").mkdir()
    recipe = parse_recipe(
        '[template]\nname = "t"\n[[component]]\nname = "base"\n[[component.step]]\nkind = "from_dir"\n'
        'path = "tree"\n[[component]]\nname = "deps"\n[[component.step]]\nkind = "run"\ncommands = "true"\n',
        base_dir=tmp_path,
    )
    store = FileStore(tmp_path / "store")
    paths = Paths(home=tmp_path / "home", cache=tmp_path / "cache", store_url=str(tmp_path / "store"))
    with pytest.raises(InvalidInputError, match=r"\['deps'\] have run/pip steps: build_recipe needs environments"):
        build_recipe(recipe, store, paths)
    assert list(store.list_manifests()) == [] and not (tmp_path / "home").exists()
