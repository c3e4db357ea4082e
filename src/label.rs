//! The [`labels!`] macro: a metric label's values as an enum, its `ALL` and `label()` generated
//! from one list, so a new value cannot be missing from `ALL` (and from the series created at
//! start-up). The enums themselves live with the metrics (`observe::metrics`) and the errors.

/// Defines a label enum: its variants with their label values, `ALL` in declaration order, and
/// `label()`.
macro_rules! labels {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$variant_meta:meta])* $variant:ident = $label:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            $( $(#[$variant_meta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The value of the metric label.
            pub fn label(self) -> &'static str {
                match self {
                    $($name::$variant => $label,)+
                }
            }
        }
    };
}
pub(crate) use labels;
