"""Every reader of a folder of feature files (`train FOLDER`, `heatmap --features FOLDER`, a feature pipeline's
`[data]` folder) takes the same files: `.h5` and `.hdf5` in any case, not a hidden writer's temporary file. The
pipeline took `*.h5` alone, hidden ones included, so it trained on other bags than `train` did (review AT A2)."""

from __future__ import annotations

from tinypipeline import feature_bags
from wsi_milssl.features.schema import feature_files_in, feature_files_of
from wsi_milssl.inference.feature_maps import find_feature_files
from wsi_milssl.pipeline.digests import feature_files


def test_the_commands_and_the_pipeline_read_the_same_files_of_a_folder(tmp_path):
    folder = tmp_path / "bags"
    feature_bags(folder, 4, 0)
    (folder / "bag_01.h5").rename(folder / "bag_01.HDF5")
    (folder / "bag_02.h5").rename(folder / "bag_02.hdf5")
    (folder / ".bag_04.h5").write_bytes((folder / "bag_03.h5").read_bytes())  # a writer's hidden file
    expected = [folder / "bag_00.h5", folder / "bag_01.HDF5", folder / "bag_02.hdf5", folder / "bag_03.h5"]
    assert feature_files_in(folder) == expected
    assert feature_files(folder) == expected
    assert find_feature_files([folder]) == expected
    assert feature_files_of([folder]) == expected  # train reads a folder so (cli/train.py)


def test_a_file_named_under_two_names_is_read_once_and_the_second_name_is_said(tmp_path, caplog):
    """Review DW, C2: a link of another name beside its target (links/patientA.h5 -> bags/bag_00.h5) was dropped
    without a word, so `heatmap --features` wrote one map fewer than the files it was given."""
    folder = tmp_path / "bags"
    feature_bags(folder, 2, 0)
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "patientA.h5").symlink_to(folder / "bag_00.h5")
    with caplog.at_level("WARNING"):
        assert feature_files_of([folder, folder / "bag_00.h5"]) == [folder / "bag_00.h5", folder / "bag_01.h5"]
        assert caplog.text == ""  # the same name twice: nothing to say
        assert feature_files_of([folder, tmp_path / "links"]) == [folder / "bag_00.h5", folder / "bag_01.h5"]
    assert (f"{tmp_path / 'links' / 'patientA.h5'} is the same file as {folder / 'bag_00.h5'} (a link): it is read "
            f"once, as {folder / 'bag_00.h5'}.") in caplog.text


def test_the_file_itself_is_kept_over_a_link_named_first(tmp_path, caplog):
    """Review EB, C2: of a file and a link to it, the name sorting first was kept, so a link's name could name the
    slide (files without a recorded slide name take the file's) and the slide itself went unevaluated."""
    folder = tmp_path / "bags"
    feature_bags(folder, 2, 0)
    (folder / "a_link.h5").symlink_to(folder / "bag_01.h5")
    with caplog.at_level("WARNING"):
        # in the place the link had (first), as the file itself
        assert feature_files_of([folder]) == [folder / "bag_01.h5", folder / "bag_00.h5"]
    assert (f"{folder / 'a_link.h5'} is the same file as {folder / 'bag_01.h5'} (a link): it is read once, as "
            f"{folder / 'bag_01.h5'}.") in caplog.text
