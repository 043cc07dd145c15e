"""Which annotation groups (ASAP ``PartOfGroup``, QuPath classification name) are tumour.

CAMELYON16 ships ASAP XML with groups ``_0`` and ``_1`` (tumour; ``Tumor`` in some files) and ``_2``
(non-tumour regions drawn inside tumour, carved out of it; ``Exclusion`` or ``None`` in some files).
QuPath exports the classification name (``Tumor``, ``Exclusion``, ...). Names are matched
case-insensitively and in one Unicode normal form (NFC, as slide names are:
:func:`wsi_milssl.cohorts.names.name_key`) after stripping spaces, so ``Tumör`` typed on one system
matches ``Tumör`` decomposed by another; a name in neither set is ignored with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

from wsi_milssl.cohorts.names import name_key
# the default groups are defined once, with the settings that default to them (review EA: two copies drifted)
from wsi_milssl.config.base import DEFAULT_NON_TUMOR_GROUPS, DEFAULT_TUMOR_GROUPS
from wsi_milssl.errors import ConfigError

__all__ = [
    "GroupMap",
    "GroupRole",
    "DEFAULT_TUMOR_GROUPS",
    "DEFAULT_NON_TUMOR_GROUPS",
    "DEFAULT_GROUP_MAP",
    "UNCLASSIFIED",
    "as_group_map",
    "groups_hiding_the_tumour",
]

GroupRole = Literal["tumor", "non_tumor"]


#: Group name given to GeoJSON features without a classification (add it to ``tumor`` to count them).
UNCLASSIFIED = "Unclassified"

#: The group ASAP writes for a polygon in no group (``PartOfGroup="None"``): non-tumour by default, as some
#: CAMELYON16 files carve regions out of tumour so, but a user's own ungrouped outlines may be the tumour.
ASAP_UNGROUPED = "None"


def _key(name: str) -> str:
    """The key group names are matched by: blanks stripped, then :func:`name_key` (case-folded, NFC)."""
    return name_key(name.strip())


@dataclass(frozen=True)
class GroupMap:
    """Group names that mean tumour and names that mean non-tumour (carved out of tumour).

    ``role(name)`` returns ``"tumor"``, ``"non_tumor"`` or None (unknown: ignored by the readers'
    users with a warning). Matching is case-insensitive and in Unicode NFC.
    """

    tumor: tuple[str, ...] = DEFAULT_TUMOR_GROUPS
    non_tumor: tuple[str, ...] = DEFAULT_NON_TUMOR_GROUPS

    def __post_init__(self) -> None:
        for field in ("tumor", "non_tumor"):
            value = getattr(self, field)
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise ConfigError(
                    f"GroupMap.{field} must be a tuple of group names; got {value!r}."
                )
            bad = [v for v in value if not isinstance(v, str) or not v.strip()]
            if bad:
                raise ConfigError(f"GroupMap.{field} must hold non-empty strings; got {bad!r}.")
            object.__setattr__(self, field, tuple(value))
        both = sorted({_key(n) for n in self.tumor} & {_key(n) for n in self.non_tumor})
        if both:
            raise ConfigError(
                f"GroupMap: group name(s) {', '.join(both)} are listed as both tumour and non-tumour; "
                "list each name once."
            )

    def role(self, name: str | None) -> GroupRole | None:
        """``"tumor"``, ``"non_tumor"`` or None for a group name (None -> ``UNCLASSIFIED``)."""
        key = _key(UNCLASSIFIED if name is None else name)
        if key in {_key(n) for n in self.tumor}:
            return "tumor"
        if key in {_key(n) for n in self.non_tumor}:
            return "non_tumor"
        return None

    def first_non_tumor(self) -> str:
        """The group name used for holes when writing ASAP XML (``_2`` by default)."""
        return self.non_tumor[0] if self.non_tumor else DEFAULT_NON_TUMOR_GROUPS[0]


DEFAULT_GROUP_MAP = GroupMap()


def as_group_map(value: GroupMap | Mapping[str, str] | None) -> GroupMap:
    """Accept a GroupMap, None (CAMELYON16 defaults) or a mapping ``{group: "tumor" | "non_tumor"}``."""
    if value is None:
        return DEFAULT_GROUP_MAP
    if isinstance(value, GroupMap):
        return value
    if isinstance(value, Mapping):
        tumor: list[str] = []
        non_tumor: list[str] = []
        for name, role in value.items():
            if role == "tumor":
                tumor.append(name)
            elif role == "non_tumor":
                non_tumor.append(name)
            else:
                raise ConfigError(
                    f"group map: role of group {name!r} must be 'tumor' or 'non_tumor'; got {role!r}."
                )
        return GroupMap(tumor=tuple(tumor), non_tumor=tuple(non_tumor))
    raise ConfigError(
        f"group_map must be a GroupMap, a mapping of group name to 'tumor'/'non_tumor', or None; "
        f"got {type(value).__name__}."
    )



def groups_hiding_the_tumour(groups: Iterable[str | None], group_map: GroupMap) -> str | None:
    """For a slide labelled tumour whose annotation has no polygon in a tumour group (``groups``: its polygons'
    groups): a clause saying which groups may hold its tumour after all, or None. Groups that are neither tumour
    nor non-tumour may; so may ASAP's ``"None"`` (:data:`ASAP_UNGROUPED`), read as non-tumour by default (review
    DX: a tumour slide outlined without groups had no lesion). An empty file, or polygons all in the other
    non-tumour groups (regions carved out alone), give None: the callers allow those with a warning."""
    names = [UNCLASSIFIED if g is None else str(g) for g in groups]
    unknown = sorted({g for g in names if group_map.role(g) is None})
    if unknown:
        return f"they are in group(s) {', '.join(repr(g) for g in unknown)}, which are neither tumour nor non-tumour"
    ungrouped = sum(_key(g) == _key(ASAP_UNGROUPED) for g in names)
    if ungrouped:
        return (f"{ungrouped} of them {'is' if ungrouped == 1 else 'are'} in group 'None', which ASAP writes for a "
                "polygon in no group and which counts as non-tumour (carved out of tumour) by default")
    return None
