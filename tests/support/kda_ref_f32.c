/* kda_ref.c with float for double (see kda_ref_f32.h): the struct of kda_ref.h is
 * replaced by kda_ref_io_f32, whose fields are the same in the same order. */
#include "kda_ref_f32.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LINMOE_TEST_KDA_REF_H /* the fp64 declarations are not wanted here */
#define kda_ref_io kda_ref_io_f32
#define kda_ref_run kda_ref_run_f32
#define double float
#include "kda_ref.c"
